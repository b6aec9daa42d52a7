#include "core/env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace moerail::env {

static std::string get(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : std::string(fallback);
}

std::string log_level() {
  std::string v = get("MOERAIL_LOG", "warn");
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return v;
}

std::string commit() { return get("MOERAIL_COMMIT", ""); }

std::string ep_trace() { return get("MOERAIL_EP_TRACE", ""); }

ContigWalk contig_walk() {
  const std::string v = get("MOERAIL_CONTIG_WALK", "auto");
  return v == "dynamic" ? ContigWalk::Dynamic : v == "static" ? ContigWalk::Static : ContigWalk::Auto;
}

}  // namespace moerail::env
