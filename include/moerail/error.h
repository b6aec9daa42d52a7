// moerail/error.h — the one error type of the library.
//
// Every failure is reported by throwing moerail::Error (library code never exits or aborts). The message names the
// operation, the argument, its value and what was expected, e.g.
//   "dispatch: topk_idx[17,3] = 300 but num_experts = 256 (expected -1 <= id < 256)".
// code() says whose fault it is: the caller's (InvalidArgument), the routing data's (BadRouting), the capacity
// policy's (CapacityOverflow), the system's (Cuda, Nccl, System) or ours (Internal).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moerail {

enum class ErrorCode { InvalidArgument, BadRouting, CapacityOverflow, Unsupported, Cuda, Nccl, System, Timeout, Internal };

std::string_view error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// Throws Error(InvalidArgument, "<op>: <what>"), the message built from the streamed arguments.
template <typename... Args>
[[noreturn]] void fail(std::string_view op, const Args&... what) {
  throw Error(ErrorCode::InvalidArgument, detail::concat(op, ": ", what...));
}

template <typename... Args>
[[noreturn]] void fail_with(ErrorCode code, std::string_view op, const Args&... what) {
  throw Error(code, detail::concat(op, ": ", what...));
}

// Collects several problems and throws them as one error; used by validate() functions that report everything.
class ProblemList {
 public:
  explicit ProblemList(std::string op) : op_(std::move(op)) {}
  template <typename... Args>
  void add(const Args&... what) {
    problems_.push_back(detail::concat(what...));
  }
  bool empty() const { return problems_.empty(); }
  void throw_if_any(ErrorCode code = ErrorCode::InvalidArgument) const;

 private:
  std::string op_;
  std::vector<std::string> problems_;
};

}  // namespace moerail
