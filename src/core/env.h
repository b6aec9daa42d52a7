// src/core/env.h — the one place that reads environment variables. Every knob is listed here.
//   MOERAIL_LOG     warn (default) | info | debug: verbosity of the library's log lines (stderr)
//   MOERAIL_COMMIT  commit id recorded in benchmark results when the binary cannot know it
#pragma once

#include <string>

namespace moerail::env {

std::string log_level();  // lower-cased MOERAIL_LOG, "warn" if unset
std::string commit();     // MOERAIL_COMMIT, "" if unset

}  // namespace moerail::env
