#include "core/env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace moerail::env {

static std::string get(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : std::string(fallback);
}

static std::string lower(std::string v) {
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return v;
}

std::string log_level() { return lower(get("MOERAIL_LOG", "warn")); }

std::string permute_copy() { return lower(get("MOERAIL_PERMUTE_COPY", "auto")); }

std::string commit() { return get("MOERAIL_COMMIT", ""); }

}  // namespace moerail::env
