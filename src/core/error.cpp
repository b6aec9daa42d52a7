#include "moerail/error.h"

namespace moerail {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidArgument: return "invalid argument";
    case ErrorCode::BadRouting: return "bad routing input";
    case ErrorCode::CapacityOverflow: return "capacity overflow";
    case ErrorCode::Unsupported: return "unsupported";
    case ErrorCode::Cuda: return "CUDA error";
    case ErrorCode::Nccl: return "NCCL error";
    case ErrorCode::System: return "system error";
    case ErrorCode::Timeout: return "timeout";
    case ErrorCode::Internal: return "internal error";
  }
  return "error";
}

Error::Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}

void ProblemList::throw_if_any(ErrorCode code) const {
  if (problems_.empty()) return;
  std::string msg = op_ + ": ";
  if (problems_.size() == 1) {
    msg += problems_[0];
  } else {
    msg += std::to_string(problems_.size()) + " problems:";
    for (const auto& p : problems_) msg += "\n  - " + p;
  }
  throw Error(code, msg);
}

}  // namespace moerail
