// A minimal JSON reader for bench_configs.json: objects, arrays, strings, numbers, true/false/null.
#include "bench_configs.h"

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "cli.h"
#include "sonicmoe/error.h"

namespace sonicmoe::tools {

namespace {

constexpr int kMaxDepth = 64;  // nesting limit: the parser recurses once per level, so deeper input would overflow the stack

struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  double number = 0;
  std::string str;  // a string's value, or a number's text as written (integer fields are parsed from it)
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
    if (c == '{' || c == '[') {
      if (depth_ == kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
      ++depth_;
      container(v, c);
      --depth_;
      return v;
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
    const char* start = s_.c_str() + i_;
    char* end = nullptr;
    errno = 0;
    v.number = std::strtod(start, &end);
    if (end == start || errno == ERANGE) fail("invalid value");
    v.str.assign(start, static_cast<std::size_t>(end - start));
    i_ += static_cast<std::size_t>(end - start);
    v.kind = Json::Number;
    return v;
  }
  // An object or array (c is its opening bracket); its members recurse into value().
  void container(Json& v, char c) {
    if (c == '{') {
      v.kind = Json::Object;
      ++i_;
      if (peek() == '}') { ++i_; return; }
      while (true) {
        std::string k = string_lit();
        expect(':');
        v.fields[k] = value();
        if (peek() == ',') { ++i_; continue; }
        expect('}');
        return;
      }
    }
    v.kind = Json::Array;
    ++i_;
    if (peek() == ']') { ++i_; return; }
    while (true) {
      v.items.push_back(value());
      if (peek() == ',') { ++i_; continue; }
      expect(']');
      return;
    }
  }

  const std::string& s_;
  std::string path_;
  std::size_t i_ = 0;
  int depth_ = 0;
};

const char* kind_name(Json::Kind k) {
  switch (k) {
    case Json::Null: return "null";
    case Json::Bool: return "a boolean";
    case Json::Number: return "a number";
    case Json::String: return "a string";
    case Json::Array: return "a list";
    case Json::Object: return "an object";
  }
  return "?";
}

// An integer field >= 1 of config `where`: the number's text goes through cli::parse_int, so 2.7 or 1e3 are refused,
// not truncated.
std::int64_t int_field(const Json& o, const std::string& key, const std::string& where, bool required = true,
                       std::int64_t fallback = 0) {
  auto it = o.fields.find(key);
  if (it == o.fields.end()) {
    SONICMOE_CHECK(!required, where, " lacks the field '", key, "'");
    return fallback;
  }
  const std::string what = where + ": field '" + key + "'";
  SONICMOE_CHECK(it->second.kind == Json::Number, what, " is ", kind_name(it->second.kind),
                 ", expected a positive integer");
  return cli::parse_int(it->second.str, what, 1, INT64_MAX);
}

// "routing": a list of mode names, or one name as a string (a one-element list); each one the tools can run.
std::vector<std::string> routing_field(const Json& o, const std::string& where) {
  auto it = o.fields.find("routing");
  if (it == o.fields.end()) return {};
  const Json& r = it->second;
  const std::string what = where + ": field 'routing'";
  if (r.kind == Json::String) {
    cli::parse_tool_routing(r.str, what);
    return {r.str};
  }
  SONICMOE_CHECK(r.kind == Json::Array, what, " is ", kind_name(r.kind), ", expected a string or a list of strings");
  std::vector<std::string> out;
  for (std::size_t i = 0; i < r.items.size(); ++i) {
    const std::string item = what + "[" + std::to_string(i) + "]";
    SONICMOE_CHECK(r.items[i].kind == Json::String, item, " is ", kind_name(r.items[i].kind), ", expected a string");
    cli::parse_tool_routing(r.items[i].str, item);
    out.push_back(r.items[i].str);
  }
  return out;
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
  for (std::size_t i = 0; i < it->second.items.size(); ++i) {
    const Json& c = it->second.items[i];
    BenchConfig b;
    auto n = c.fields.find("name");
    SONICMOE_CHECK(n != c.fields.end() && n->second.kind == Json::String, "bench configs ", path, ": config ", i,
                   " lacks a string 'name'");
    b.name = n->second.str;
    const std::string where = "bench configs " + path + ": config '" + b.name + "'";
    b.T = int_field(c, "T", where);
    b.H = int_field(c, "H", where);
    b.I = int_field(c, "I", where);
    b.E = int_field(c, "E", where);
    b.K = int_field(c, "K", where);
    b.tile = int_field(c, "tile", where, false, 128);
    b.routing = routing_field(c, where);
    out.push_back(b);
  }
  return out;
}

}  // namespace sonicmoe::tools
