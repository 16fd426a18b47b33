// Command-line helpers shared by sonicmoe-bench, its configs file and train_moe: every integer a user writes goes
// through parse_int, and every main() through run_main, so a bad argument ends as "error: ..." and exit code 2
// (never an abort, a bare "stoi", or a silently truncated or ignored value).
#pragma once

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "sonicmoe/error.h"
#include "sonicmoe/types.h"

namespace sonicmoe::cli {

// `text` as a whole decimal integer in [lo, hi]. Fractions ("8.5"), exponents, trailing or leading junk, empty
// text and out-of-range values all throw Error naming `what` (the flag or field) and the text.
inline std::int64_t parse_int(const std::string& text, const std::string& what, std::int64_t lo, std::int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  const bool whole = !text.empty() && !std::isspace(static_cast<unsigned char>(text[0])) &&
                     end == text.c_str() + text.size();
  SONICMOE_CHECK(whole, what, ": '", text, "' is not an integer");
  SONICMOE_CHECK(errno != ERANGE && v >= lo && v <= hi, what, " = ", text, " is out of range, expected ", lo,
                 " to ", hi);
  return v;
}

// "a,b,c" split at every comma (empty items kept, so "1,,2" and "1,2," are refused by parse_int).
inline std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> items(1);
  for (char c : text) {
    if (c == ',') items.emplace_back();
    else items.back() += c;
  }
  return items;
}

// fn() with any Error it throws prefixed by `what` (the flag or field), e.g. for the library's parse_backend.
template <class Fn>
auto with_flag(const std::string& what, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
}

// A routing mode the tools can run: they build top-K or token-rounding routings from a random router, so general
// routing (the caller's own (token, expert, score) triples) has nothing to run on. `what` names the flag or field.
inline RoutingMode parse_tool_routing(const std::string& name, const std::string& what) {
  const RoutingMode m = with_flag(what, [&] { return parse_routing_mode(name); });
  SONICMOE_CHECK(m != RoutingMode::general, what, " = ", name,
                 ": general routing is not supported by this tool (it has no (token, expert, score) triples to "
                 "pass; use the C++ API or the PyTorch binding); expected topk, round-down, round-up or round-nearest");
  return m;
}

// `text` on one line: control characters (a newline or escape sequence inside an echoed argument or config name)
// written as \n, \t or \xHH, so that an error stays one line on stderr.
inline std::string one_line(const std::string& text) {
  std::string out;
  for (char c : text) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", u);
      out += b;
    } else out += c;
  }
  return out;
}

// Runs body() (returning the exit code); any exception becomes "error: <message>" (one line) on stderr and exit
// code 2.
template <class Fn>
int run_main(Fn&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    std::fputs("error: out of memory (std::bad_alloc): the problem does not fit in this machine's memory\n", stderr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", one_line(e.what()).c_str());
  } catch (...) {
    std::fputs("error: unknown exception\n", stderr);
  }
  return 2;
}

// Flags that take one value: a second occurrence would silently override the first, so it is an Error naming both.
// Flags that collect a list (--config, --routing, ...) refuse a repeated item instead (it would run twice).
class SeenFlags {
 public:
  explicit SeenFlags(const char* prog) : prog_(prog) {}
  // `flag` given with `value`: an Error when it was given before.
  void once(const std::string& flag, const std::string& value) {
    for (const auto& [f, v] : seen_)
      SONICMOE_CHECK(f != flag, prog_, ": option ", flag, " given twice ('", v, "' and '", value,
                     "'); give it once");
    seen_.emplace_back(flag, value);
  }
  // `value` added to the list of `flag`: an Error when the list has it already.
  static void unique_item(const char* prog, const std::string& flag, const std::vector<std::string>& list,
                          const std::string& value) {
    for (const auto& v : list)
      SONICMOE_CHECK(v != value, prog, ": option ", flag, " ", value, " given twice; give each value once");
  }

 private:
  const char* prog_;
  std::vector<std::pair<std::string, std::string>> seen_;
};

// Calls on_option(flag, value) for each command-line argument after the program name: `flag` is the argument and
// value() consumes the next one as its value (an Error "<prog>: option <flag> needs a value" when there is none).
template <class F>
void for_each_option(int argc, char** argv, const char* prog, F&& on_option) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    on_option(flag, [&]() -> std::string {
      SONICMOE_CHECK(i + 1 < argc, prog, ": option ", flag, " needs a value");
      return argv[++i];
    });
  }
}

}  // namespace sonicmoe::cli
