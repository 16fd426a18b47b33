// A minimal JSON reader for bench_configs.json: objects, arrays, strings, numbers, true/false/null.
#include "bench_configs.h"

#include <cctype>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "sonicmoe/error.h"

namespace sonicmoe::tools {

namespace {

struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  double number = 0;
  std::string str;
  std::vector<Json> items;
  std::map<std::string, Json> fields;
};

class Parser {
 public:
  Parser(const std::string& text, const std::string& path) : s_(text), path_(path) {}
  Json parse() {
    Json v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw Error("bench configs " + path_ + ": " + what + " at offset " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end of file");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  std::string string_lit() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\' && i_ + 1 < s_.size()) ++i_;
      out += s_[i_++];
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  Json value() {
    Json v;
    char c = peek();
    if (c == '{') {
      v.kind = Json::Object;
      ++i_;
      if (peek() == '}') { ++i_; return v; }
      while (true) {
        std::string k = string_lit();
        expect(':');
        v.fields[k] = value();
        if (peek() == ',') { ++i_; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::Array;
      ++i_;
      if (peek() == ']') { ++i_; return v; }
      while (true) {
        v.items.push_back(value());
        if (peek() == ',') { ++i_; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::String;
      v.str = string_lit();
      return v;
    }
    for (const char* word : {"true", "false", "null"}) {
      if (s_.compare(i_, std::char_traits<char>::length(word), word) == 0) {
        i_ += std::char_traits<char>::length(word);
        v.kind = word[0] == 'n' ? Json::Null : Json::Bool;
        v.number = word[0] == 't';
        return v;
      }
    }
    std::size_t used = 0;
    try {
      v.number = std::stod(s_.substr(i_), &used);
    } catch (const std::exception&) {
      fail("invalid value");
    }
    i_ += used;
    v.kind = Json::Number;
    return v;
  }

  const std::string& s_;
  std::string path_;
  std::size_t i_ = 0;
};

std::int64_t int_field(const Json& o, const std::string& key, const std::string& path, bool required = true,
                       std::int64_t fallback = 0) {
  auto it = o.fields.find(key);
  if (it == o.fields.end()) {
    SONICMOE_CHECK(!required, "bench configs ", path, ": a config lacks the field '", key, "'");
    return fallback;
  }
  SONICMOE_CHECK(it->second.kind == Json::Number && it->second.number >= 1, "bench configs ", path, ": field '",
                 key, "' must be a positive number");
  return static_cast<std::int64_t>(it->second.number);
}

}  // namespace

std::vector<BenchConfig> load_bench_configs(const std::string& path) {
  std::ifstream f(path);
  SONICMOE_CHECK(f.good(), "bench configs: cannot open '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  Json root = Parser(text, path).parse();
  auto it = root.fields.find("configs");
  SONICMOE_CHECK(root.kind == Json::Object && it != root.fields.end() && it->second.kind == Json::Array,
                 "bench configs ", path, ": expected an object with a \"configs\" array");
  std::vector<BenchConfig> out;
  for (const Json& c : it->second.items) {
    BenchConfig b;
    auto n = c.fields.find("name");
    SONICMOE_CHECK(n != c.fields.end() && n->second.kind == Json::String, "bench configs ", path,
                   ": a config lacks a string 'name'");
    b.name = n->second.str;
    b.T = int_field(c, "T", path);
    b.H = int_field(c, "H", path);
    b.I = int_field(c, "I", path);
    b.E = int_field(c, "E", path);
    b.K = int_field(c, "K", path);
    b.tile = int_field(c, "tile", path, false, 128);
    auto r = c.fields.find("routing");
    if (r != c.fields.end())
      for (const Json& m : r->second.items) b.routing.push_back(m.str);
    out.push_back(b);
  }
  return out;
}

}  // namespace sonicmoe::tools
