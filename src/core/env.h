// src/core/env.h — the one place that reads environment variables. Every knob is listed here.
//   MOERAIL_LOG     warn (default) | info | debug: verbosity of the library's log lines (stderr)
//   MOERAIL_COMMIT  commit id recorded in benchmark results when the binary cannot know it
//   MOERAIL_PERMUTE_COPY  auto (default) | bulk | sm: the engine permute_forward copies 16-byte-aligned rows with
//                   (auto: the bulk copy engine for rows of at least 512 bytes, else SM loads/stores); for
//                   measurements and tests of both paths
#pragma once

#include <string>

namespace moerail::env {

std::string log_level();  // lower-cased MOERAIL_LOG, "warn" if unset
std::string commit();     // MOERAIL_COMMIT, "" if unset
std::string permute_copy();  // lower-cased MOERAIL_PERMUTE_COPY, "auto" if unset

}  // namespace moerail::env
