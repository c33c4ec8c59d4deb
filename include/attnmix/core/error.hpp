#pragma once
// attnmix::error and the message helpers every front door uses.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace attnmix {

// Thrown by every public call that rejects its arguments. The message has the form
// "<function>: argument '<name>' <what is wrong, with both sizes>". When a call throws, no
// output buffer has been written.
class error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}

// Throws attnmix::error("<fn>: argument '<arg>' <what...>").
template <class... What>
[[noreturn]] void fail(const std::string& fn, const char* arg, What&&... what) {
  throw error(concat(fn, ": argument '", arg, "' ", std::forward<What>(what)...));
}

template <class... What>
void require(bool ok, const std::string& fn, const char* arg, What&&... what) {
  if (!ok) fail(fn, arg, std::forward<What>(what)...);
}

}  // namespace detail
}  // namespace attnmix
