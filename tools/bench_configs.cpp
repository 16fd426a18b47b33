// A minimal JSON reader for bench_configs.json: objects, arrays, strings, numbers, true/false/null.
#include "bench_configs.h"

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <initializer_list>
#include <sys/stat.h>
#include <cstring>

#include "cli.h"
#include "sonicmoe/error.h"

namespace sonicmoe::tools {

namespace {

constexpr int kMaxDepth = 64;
constexpr long long kMaxFileBytes = 64ll << 20;  // a configs file is a few KiB; far larger input is not one  // nesting limit: the parser recurses once per level, so deeper input would overflow the stack

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
  // A JSON string: escapes decoded (\uXXXX, surrogate pairs included, to UTF-8), raw control characters and
  // unknown escapes refused (they used to be kept or dropped silently: "\u0041" read as "u0041").
  std::string string_lit() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      const unsigned char c = static_cast<unsigned char>(s_[i_]);
      if (c < 0x20) fail("control character " + std::to_string(c) + " inside a string (escape it)");
      if (c != '\\') {
        out += s_[i_++];
        continue;
      }
      if (++i_ >= s_.size()) break;
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a high surrogate: its low half must follow
            if (s_.compare(i_, 2, "\\u") != 0) fail("unpaired UTF-16 surrogate in a \\u escape");
            i_ += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired UTF-16 surrogate in a \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired UTF-16 surrogate in a \\u escape");
          }
          if (cp == 0) fail("\\u0000 (a NUL character) inside a string");
          utf8(cp, out);
          break;
        }
        default: --i_; fail(std::string("invalid escape '\\") + e + "' inside a string");
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  std::uint32_t hex4() {
    std::uint32_t v = 0;
    for (int k = 0; k < 4; ++k, ++i_) {
      if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_]))) fail("\\u needs 4 hex digits");
      const char h = static_cast<char>(std::tolower(static_cast<unsigned char>(s_[i_])));
      v = v * 16 + static_cast<std::uint32_t>(h <= '9' ? h - '0' : h - 'a' + 10);
    }
    return v;
  }
  static void utf8(std::uint32_t cp, std::string& out) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  // The length of a JSON number at i_ (-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?), 0 when there is none.
  std::size_t number_length() const {
    std::size_t j = i_;
    auto digits = [&] {
      const std::size_t from = j;
      while (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) ++j;
      return j - from;
    };
    if (j < s_.size() && s_[j] == '-') ++j;
    if (j < s_.size() && s_[j] == '0') ++j;
    else if (digits() == 0) return 0;
    if (j < s_.size() && s_[j] == '.') {
      ++j;
      if (digits() == 0) return 0;
    }
    if (j < s_.size() && (s_[j] == 'e' || s_[j] == 'E')) {
      ++j;
      if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) ++j;
      if (digits() == 0) return 0;
    }
    // a word glued to the number ("12abc", "0x10", "1.5.2") is not a number either
    if (j < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[j])) || s_[j] == '.' || s_[j] == '_')) return 0;
    return j - i_;
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
      const std::size_t n = std::char_traits<char>::length(word);
      if (s_.compare(i_, n, word) == 0 &&
          (i_ + n == s_.size() || !std::isalnum(static_cast<unsigned char>(s_[i_ + n])))) {
        i_ += n;
        v.kind = word[0] == 'n' ? Json::Null : Json::Bool;
        v.number = word[0] == 't';
        return v;
      }
    }
    // Strict JSON numbers: strtod alone also took "NaN", "Infinity", "0x40" and "+64".
    const std::size_t n = number_length();
    if (n == 0) {
      std::size_t j = i_;
      while (j < s_.size() && j - i_ < 24 && !std::isspace(static_cast<unsigned char>(s_[j])) && s_[j] != ',' &&
             s_[j] != '}' && s_[j] != ']')
        ++j;
      std::string word = s_.substr(i_, j - i_);
      for (char& ch : word)
        if (!std::isprint(static_cast<unsigned char>(ch))) ch = '?';
      fail("invalid value '" + word + "' (JSON values are strings, decimal numbers, true, false, null, lists and "
           "objects: no NaN, Infinity, hex or leading '+')");
    }
    v.str = s_.substr(i_, n);
    v.number = std::strtod(v.str.c_str(), nullptr);  // +-inf past double's range: integer fields parse the text
    i_ += n;
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
        const std::size_t key_at = i_;
        std::string k = string_lit();
        expect(':');
        if (v.fields.count(k)) {  // the later value used to replace the earlier one silently
          i_ = key_at;
          fail("duplicate key \"" + k + "\" in an object");
        }
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
  SONICMOE_CHECK(!r.items.empty(), what, " is an empty list, expected at least one routing mode (or no field: topk)");
  std::vector<std::string> out;
  for (std::size_t i = 0; i < r.items.size(); ++i) {
    const std::string item = what + "[" + std::to_string(i) + "]";
    SONICMOE_CHECK(r.items[i].kind == Json::String, item, " is ", kind_name(r.items[i].kind), ", expected a string");
    cli::parse_tool_routing(r.items[i].str, item);
    for (const auto& seen : out)  // the mode would run twice
      SONICMOE_CHECK(seen != r.items[i].str, item, " = ", r.items[i].str, " repeats an earlier entry of the list");
    out.push_back(r.items[i].str);
  }
  return out;
}

// The file's text. Only a regular file, and at most kMaxFileBytes: a FIFO would block, /dev/zero never ends.
std::string read_configs_file(const std::string& path) {
  struct stat st {};
  SONICMOE_CHECK(::stat(path.c_str(), &st) == 0, "bench configs: cannot open '", path, "' (", std::strerror(errno),
                 ")");
  SONICMOE_CHECK(S_ISREG(st.st_mode), "bench configs: '", path, "' is ",
                 S_ISDIR(st.st_mode) ? "a directory" : "not a regular file", ", expected a JSON file");
  SONICMOE_CHECK(st.st_size <= kMaxFileBytes, "bench configs: '", path, "' is ", static_cast<long long>(st.st_size),
                 " bytes, more than the limit of ", kMaxFileBytes, " bytes for a configs file");
  std::ifstream f(path, std::ios::binary);
  SONICMOE_CHECK(f.good(), "bench configs: cannot open '", path, "'");
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  f.read(&text[0], static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(f.gcount()));
  return text;
}

// Keys an object may have; others (typos such as "tiel") are an Error, except "_"-prefixed comment keys ("_doc").
void known_keys(const Json& o, std::initializer_list<const char*> keys, const std::string& where) {
  for (const auto& [k, v] : o.fields) {
    if (!k.empty() && k[0] == '_') continue;
    bool known = false;
    std::string list;
    for (const char* key : keys) {
      known = known || k == key;
      list += (list.empty() ? "" : ", ") + std::string(key);
    }
    SONICMOE_CHECK(known, where, " has an unknown field '", k, "', expected ", list,
                   " (or a '_'-prefixed comment field)");
  }
}

}  // namespace

std::vector<BenchConfig> load_bench_configs(const std::string& path) {
  const std::string text = read_configs_file(path);
  Json root = Parser(text, path).parse();
  auto it = root.fields.find("configs");
  SONICMOE_CHECK(root.kind == Json::Object && it != root.fields.end() && it->second.kind == Json::Array,
                 "bench configs ", path, ": expected an object with a \"configs\" array");
  known_keys(root, {"configs"}, "bench configs " + path);
  std::vector<BenchConfig> out;
  for (std::size_t i = 0; i < it->second.items.size(); ++i) {
    const Json& c = it->second.items[i];
    SONICMOE_CHECK(c.kind == Json::Object, "bench configs ", path, ": config ", i, " is ", kind_name(c.kind),
                   ", expected an object");
    BenchConfig b;
    auto n = c.fields.find("name");
    SONICMOE_CHECK(n != c.fields.end() && n->second.kind == Json::String && !n->second.str.empty(), "bench configs ",
                   path, ": config ", i, " lacks a non-empty string 'name'");
    b.name = n->second.str;
    for (std::size_t j = 0; j < out.size(); ++j)
      SONICMOE_CHECK(out[j].name != b.name, "bench configs ", path, ": configs ", j, " and ", i, " are both named '",
                     b.name, "' (--config NAME would run both)");
    const std::string where = "bench configs " + path + ": config '" + b.name + "'";
    known_keys(c, {"name", "T", "H", "I", "E", "K", "tile", "routing"}, where);
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
