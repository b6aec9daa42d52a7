// src/core/log.h — one logging facility. MOERAIL_LOG=warn|info|debug selects what is printed (stderr); every line
// carries the rank and device of the process: "moerail[rank 1 cuda:1] info: ...".
#pragma once

#include <string>

#include "moerail/error.h"

namespace moerail::log {

enum class Level { Warn = 0, Info = 1, Debug = 2 };

bool enabled(Level level);
void set_identity(int rank, int device);  // rank -1 = not in a group; device -1 = host
void write(Level level, const std::string& message);

template <typename... Args>
void warn(const Args&... a) { if (enabled(Level::Warn)) write(Level::Warn, detail::concat(a...)); }
template <typename... Args>
void info(const Args&... a) { if (enabled(Level::Info)) write(Level::Info, detail::concat(a...)); }
template <typename... Args>
void debug(const Args&... a) { if (enabled(Level::Debug)) write(Level::Debug, detail::concat(a...)); }

}  // namespace moerail::log
