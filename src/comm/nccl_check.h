// src/comm/nccl_check.h — turning NCCL failures into moerail::Error(ErrorCode::Nccl) that name the rank and the op:
//   "ncclCommInitRank: rank 1: unhandled system error (...) at src/comm/communicator.cu:60"
#pragma once

#include <nccl.h>

#include "moerail/error.h"

#define MOERAIL_NCCL_CHECK(call, op, rank)                                                                      \
  do {                                                                                                        \
    const ncclResult_t moerail_nccl_ = (call);                                                                \
    if (moerail_nccl_ != ncclSuccess && moerail_nccl_ != ncclInProgress)                                      \
      ::moerail::fail_with(::moerail::ErrorCode::Nccl, op, "rank ", rank, ": ", ncclGetErrorString(moerail_nccl_), \
                           " (", ncclGetLastError(nullptr), ") at ", __FILE__, ":", __LINE__);                \
  } while (0)
