#pragma once
// Errors are exceptions that say which rank raised them and what was wrong. The rank is
// process-wide context set by the communication layer once it knows it. The source location
// where one was raised is kept out of the message users read, except in a debug build of the
// library or with TESSERA_ERROR_LOCATION=1 (=0 hides it in a debug build); file() and line()
// always have it.
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what);
  Error(const std::string& what, const char* file, int line);

  // Where TESSERA_CHECK/TESSERA_FAIL raised it, as the compiler spelled the path; "" and 0 for
  // an Error made directly.
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  const char* file_ = "";
  int line_ = 0;
};

// -1 until a runtime sets it; messages then carry "[rank r]".
void set_error_rank(int rank);
int error_rank();

// `parts` separated by `sep`, for messages that list names ("a, b, c").
std::string join(const std::vector<std::string>& parts, const std::string& sep = ", ");

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace tessera

#define TESSERA_CHECK(cond, ...)                                                                  \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      ::tessera::detail::throw_error(__FILE__, __LINE__, ::tessera::detail::concat(__VA_ARGS__)); \
    }                                                                                             \
  } while (0)

#define TESSERA_FAIL(...) \
  ::tessera::detail::throw_error(__FILE__, __LINE__, ::tessera::detail::concat(__VA_ARGS__))
