#include "core/log.h"

#include <cstdio>
#include <mutex>

#include "core/env.h"

namespace moerail::log {
namespace {

struct State {
  Level level;
  int rank = -1, device = -1;
  std::mutex mutex;
  State() {
    const std::string v = env::log_level();
    level = v == "debug" ? Level::Debug : v == "info" ? Level::Info : Level::Warn;
    if (v != "debug" && v != "info" && v != "warn")
      std::fprintf(stderr, "moerail warn: MOERAIL_LOG=%s is not one of warn, info, debug; using warn\n", v.c_str());
  }
};

State& state() {
  static State s;
  return s;
}

}  // namespace

bool enabled(Level level) { return int(level) <= int(state().level); }

void set_identity(int rank, int device) {
  std::lock_guard lock(state().mutex);
  state().rank = rank;
  state().device = device;
}

void write(Level level, const std::string& message) {
  static const char* names[] = {"warn", "info", "debug"};
  State& s = state();
  std::lock_guard lock(s.mutex);
  std::string who;
  if (s.rank >= 0) who += "rank " + std::to_string(s.rank);
  if (s.device >= 0) who += (who.empty() ? "" : " ") + std::string("cuda:") + std::to_string(s.device);
  std::fprintf(stderr, "moerail[%s] %s: %s\n", who.empty() ? "host" : who.c_str(), names[int(level)],
               message.c_str());
}

}  // namespace moerail::log
