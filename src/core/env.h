// src/core/env.h — the one place that reads environment variables. Every knob is listed here.
//   MOERAIL_LOG     warn (default) | info | debug: verbosity of the library's log lines (stderr)
//   MOERAIL_COMMIT  commit id recorded in benchmark results when the binary cannot know it
//   MOERAIL_EP_TRACE  path prefix: dispatch/combine kernels record per-warp timelines, appended by
//                     Dispatcher::check() to <prefix>.rank<r>.jsonl (docs/dispatch.md); unset = off; needs a build
//                     configured with -DMOERAIL_EP_TRACE=ON
//   MOERAIL_CONTIG_WALK  auto (default) | dynamic | static: how the contiguous expert GEMMs' clusters take their
//                        tiles (src/experts/contig/contig_gemm.h, contig_walk_dynamic and contig_wgrad_walk_dynamic); the
//                        two forced ones for A/B runs
#pragma once

#include <string>

namespace moerail::env {

std::string log_level();  // lower-cased MOERAIL_LOG, "warn" if unset
std::string commit();     // MOERAIL_COMMIT, "" if unset
std::string ep_trace();   // MOERAIL_EP_TRACE, "" if unset
enum class ContigWalk { Auto, Dynamic, Static };
ContigWalk contig_walk();  // MOERAIL_CONTIG_WALK; Auto if unset; throws InvalidArgument on another value

}  // namespace moerail::env
