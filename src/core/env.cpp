#include "core/env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "moerail/error.h"

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
  if (v == "auto") return ContigWalk::Auto;
  if (v == "dynamic") return ContigWalk::Dynamic;
  if (v == "static") return ContigWalk::Static;
  fail("environment", "MOERAIL_CONTIG_WALK = '", v, "' but it must be auto, dynamic or static");
}

}  // namespace moerail::env
