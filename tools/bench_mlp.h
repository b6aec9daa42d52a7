// tools/bench_mlp.h — the expert-MLP benchmark cases, shared by `moerail bench mlp` (bench_mlp.cu) and
// `moerail bench mlp-fp8` (bench_mlp_fp8.cu): the grouped-MLP issue's shapes, their configuration and row counts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bench.h"
#include "moerail/config.h"
#include "moerail/error.h"

namespace moerail::tools {

// Preset shapes with L local experts and `rows` received rows.
struct MlpCase {
  const char* preset;
  std::int64_t L, rows;
};
inline constexpr MlpCase kMlpCases[] = {
    {"deepseek-v3", 32, 32768},
    {"qwen3-30b-a3b", 128, 131072},
    {"mixtral-8x7b", 8, 16384},
};
inline constexpr double kMlpZipf = 1.2;  // exponent of the skewed routing

// The cases --config selects ("all" or one preset); the error lists the known names.
inline std::vector<const MlpCase*> select_mlp_cases(const BenchOptions& o, std::string_view bench) {
  std::vector<const MlpCase*> cases;
  for (const MlpCase& c : kMlpCases)
    if (o.config == "all" || o.config == c.preset) cases.push_back(&c);
  if (cases.empty())
    fail(std::string("moerail bench ") + std::string(bench), "unknown case '", o.config,
         "' (known: deepseek-v3, qwen3-30b-a3b, mixtral-8x7b, all)");
  return cases;
}

// The preset at EP = E / L (every expert local to one of E / L ranks).
inline MoeConfig mlp_case_config(const MlpCase& c) {
  MoeConfig cfg = preset_config(c.preset);
  if (cfg.num_experts % c.L != 0) fail("moerail bench mlp", c.preset, ": E = ", cfg.num_experts, " but L = ", c.L);
  cfg.ep_size = cfg.num_experts / c.L;
  cfg.topk = std::min(cfg.topk, cfg.num_experts);
  return cfg;
}

// --tokens T: the rows a rank receives under balanced routing at EP = E / L, T K L / E; default the rows.
inline std::int64_t mlp_case_rows(const MlpCase& c, const MoeConfig& cfg, const BenchOptions& o) {
  return o.tokens > 0 ? std::max<std::int64_t>(c.L * cfg.align, o.tokens * cfg.topk * c.L / cfg.num_experts)
                      : c.rows;
}

// Rows per expert: balanced, or Zipf(1.2) over the experts in index order; multiples of the alignment A.
inline std::vector<std::int64_t> mlp_case_counts(std::int64_t L, std::int64_t rows, std::int64_t A, bool zipf) {
  std::vector<double> w(std::size_t(L), 1.0);
  if (zipf)
    for (std::int64_t e = 0; e < L; ++e) w[std::size_t(e)] = 1.0 / std::pow(double(e + 1), kMlpZipf);
  double sum = 0;
  for (double v : w) sum += v;
  std::vector<std::int64_t> c(static_cast<std::size_t>(L));
  for (std::int64_t e = 0; e < L; ++e) c[std::size_t(e)] = std::int64_t(double(rows) * w[std::size_t(e)] / sum) / A * A;
  return c;
}

}  // namespace moerail::tools
