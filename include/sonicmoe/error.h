// One exception type for every failure the library reports; messages name the argument and what was
// expected so a caller can fix the call without reading our source.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace sonicmoe {

class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

// Messages are built with plain string appends, not iostreams: inside a PyTorch extension on some torch builds
// any std::ostream use from this library crashed the process (seen on the H100 machine's torch 2.11 / py3.12).
namespace detail {
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T>
void append(std::string& s, const T& v) {
  if constexpr (std::is_integral_v<T>) {
    s += std::to_string(v);
  } else if constexpr (std::is_enum_v<T>) {
    s += std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", static_cast<double>(v));
    s += b;
  } else if constexpr (std::is_pointer_v<T>) {
    char b[32];
    std::snprintf(b, sizeof b, "%p", static_cast<const void*>(v));
    s += b;
  } else {
    static_assert(sizeof(T) == 0, "sonicmoe error messages take strings, numbers, enums and pointers");
  }
}
template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
}  // namespace detail

}  // namespace sonicmoe

// SONICMOE_CHECK(cond, "where: argument 'x' ...", values...) throws sonicmoe::Error when cond is false.
#define SONICMOE_CHECK(cond, ...)                                          \
  do {                                                                     \
    if (!(cond)) throw ::sonicmoe::Error(::sonicmoe::detail::concat(__VA_ARGS__)); \
  } while (0)
