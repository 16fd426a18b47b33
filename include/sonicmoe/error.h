// One exception type for every failure the library reports; messages name the argument and what was
// expected so a caller can fix the call without reading our source.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace sonicmoe {

class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append_all(os, rest...);
}
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  append_all(os, args...);
  return os.str();
}
}  // namespace detail

}  // namespace sonicmoe

// SONICMOE_CHECK(cond, "where: argument 'x' ...", values...) throws sonicmoe::Error when cond is false.
#define SONICMOE_CHECK(cond, ...)                                          \
  do {                                                                     \
    if (!(cond)) throw ::sonicmoe::Error(::sonicmoe::detail::concat(__VA_ARGS__)); \
  } while (0)
