// `moerail bench <name>`: the registry of benches; runs the one named (on one GPU, or in a worker process per GPU),
// prints its rows as a table, writes/merges them as JSON.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <utility>

#include "bench.h"
#include "build_commit.h"  // MOERAIL_BUILD_COMMIT (generated at build time)
#include "commands.h"
#include "core/env.h"
#include "core/log.h"
#if MOERAIL_WITH_NCCL
#include "bench_ep.h"
#include "layer_gpu.h"
#include "moerail/comm.h"
#endif
#include "moerail/error.h"

namespace moerail::tools {
namespace {

std::string today() {
  const std::time_t t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

// "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100"; otherwise the name in lower case, [a-z0-9-] only.
std::string short_gpu_name(const std::string& name) {
  std::string lower;
  for (char c : name) lower += char(std::tolower(static_cast<unsigned char>(c)));
  for (const char* known : {"h200", "h100", "h800", "h20", "b200", "gb200", "a100"})
    if (lower.find(known) != std::string::npos) return known;
  std::string out;
  for (char c : lower) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
  return out;
}

void merge_into(const std::string& path, const nlohmann::json& rows) {
  nlohmann::json all = nlohmann::json::array();
  if (std::ifstream in(path); in) {
    try {
      in >> all;
    } catch (const std::exception& e) {
      fail("bench", "--record: ", path, " is not a JSON array (", e.what(), "); not overwriting it");
    }
    if (!all.is_array()) fail("bench", "--record: ", path, " is not a JSON array; not overwriting it");
  }
  for (const auto& row : rows) {
    auto same = [&](const nlohmann::json& r) {
      return r.value("bench", "") == row["bench"] && r.value("case", "") == row["case"] &&
             r.value("direction", "") == row["direction"];
    };
    all.erase(std::remove_if(all.begin(), all.end(), same), all.end());
    all.push_back(row);
  }
  std::ofstream out(path);
  if (!out) fail("bench", "--record: cannot write ", path);
  out << all.dump(2) << "\n";
}

}  // namespace

nlohmann::json to_json(const BenchRow& r, const std::string& commit, const std::string& date) {
  nlohmann::json j;
  j["bench"] = r.bench;
  j["case"] = r.case_name;
  j["direction"] = r.direction;
  j["gpu"] = r.gpu;
  j["gpus"] = r.gpus;
  j["commit"] = commit;
  j["date"] = date;
  j["time_us"] = r.time_us;
  j["metric"] = r.metric;
  j["value"] = r.value;
  j["ceiling"] = r.ceiling ? nlohmann::json{{"name", r.ceiling->name}, {"value", r.ceiling->value}} : nullptr;
  if (r.baseline) {
    j["baseline"] = {{"name", r.baseline->name}, {"value", r.baseline->value}};
    j["baseline"]["time_us"] = r.baseline->time_us ? nlohmann::json(*r.baseline->time_us) : nullptr;
  } else {
    j["baseline"] = nullptr;
  }
  j["floor_us"] = r.floor_us ? nlohmann::json(*r.floor_us) : nullptr;
  j["verified"] = r.verified.empty() ? "no" : r.verified;
  j["config"] = r.config;
  return j;
}

namespace {

// ---- the runners of the registry: each bench's entry point with the options it takes ----

std::vector<BenchRow> router_rows(const BenchRun& r) { return run_kernel_bench("router", r.options); }
std::vector<BenchRow> permute_rows(const BenchRun& r) { return run_kernel_bench("permute", r.options); }
std::vector<BenchRow> combine_rows(const BenchRun& r) { return run_kernel_bench("combine", r.options); }
std::vector<BenchRow> mlp_rows(const BenchRun& r) { return run_mlp_bench(r.options); }
std::vector<BenchRow> mlp_fp8_rows(const BenchRun& r) { return run_mlp_fp8_bench(r.options); }

#if MOERAIL_WITH_NCCL
std::vector<BenchRow> ep_rows(const BenchRun& r) { return run_ep_bench(r.command.name, r.options, *r.comm, *r.ep); }
std::vector<BenchRow> layer_rows(const BenchRun& r) {
  std::vector<long long> tokens{512, 1024, 2048, 4096, 8192, 16384};
  if (r.options.tokens > 0) tokens = {r.options.tokens};
  return run_layer_bench(r.options, r.command.layer, *r.comm, *r.ep, tokens);
}
#else
[[noreturn]] void no_nccl(const std::string& name) {
  fail_with(ErrorCode::Unsupported, "bench " + name, "this build has no NCCL (multi-GPU ops left out)");
}
// Never reached: run_across_gpus refuses first in a build without NCCL.
std::vector<BenchRow> ep_rows(const BenchRun& r) { no_nccl(r.command.name); }
std::vector<BenchRow> layer_rows(const BenchRun& r) { no_nccl(r.command.name); }
#endif

// The registry: one entry per `moerail bench <name>`, in the order the help and the unknown-name error list them.
constexpr BenchEntry kBenches[] = {
    {"router", "the router's forward and backward on one GPU, and its top-k selection alone (case <case>-topk)",
     router_rows, nullptr},
    {"permute", "the Dispatcher's dispatch and its backward at one rank, bf16 and FP8 (row permute-fp8)",
     permute_rows, nullptr},
    {"combine", "the Dispatcher's combine and its backward at one rank; with --gpus, the combine expert-parallel "
                "across GPUs",
     combine_rows, ep_rows},
    {"dispatch", "the dispatch expert-parallel across GPUs (--gpus), beside the peer-copy and HBM floors", nullptr,
     ep_rows},
    {"dispatch-fp8", "the FP8 dispatch expert-parallel across GPUs (--gpus), beside the bf16 one", nullptr, ep_rows},
    {"mlp", "the grouped expert MLP, forward and backward, beside dense cuBLAS and torch._grouped_mm (--config all: "
            "every case)",
     mlp_rows, nullptr},
    {"mlp-fp8", "the FP8 grouped GEMMs: forward, dgrad and wgrad beside the bf16 ones (--config all: every case)",
     mlp_fp8_rows, nullptr},
    {"layer", "the whole layer, forward + backward, for 512 to 16384 tokens per rank or --tokens; one GPU, or "
              "expert-parallel across --gpus",
     nullptr, layer_rows},
};

bool runs_across_gpus(const BenchEntry& b, const BenchCommandOptions& o) {
  return b.across_gpus && (!b.one_gpu || o.gpus > 0);
}

// An across-GPU bench: spawns the workers (this process then returns no rows), or runs as one of them; only rank 0
// returns its rows, the others none (rank 0 prints and writes).
std::optional<std::vector<BenchRow>> run_across_gpus(const BenchEntry& b, const BenchCommandOptions& o,
                                                     const BenchOptions& opts) {
#if MOERAIL_WITH_NCCL
  const Transport transport = parse_transport(o.transport, "--transport");
  const Capacity capacity = parse_capacity(o.capacity, "--capacity");
  if (o.ranks_per_node > 0 && o.gpus % o.ranks_per_node != 0)  // (-1: the Dispatcher's NVLink domain)
    fail("bench " + o.name, "--ranks-per-node ", o.ranks_per_node, " must divide --gpus ", o.gpus);
  if (std::getenv("MOERAIL_WORLD_SIZE") == nullptr && o.gpus > 1) {
    SpawnOptions so;
    so.rendezvous = o.rendezvous;
    so.nnodes = o.nnodes;
    so.node_rank = o.node_rank;
    const std::string failure = spawn_local_workers(o.gpus, o.argv, so);
    if (!failure.empty()) fail_with(ErrorCode::System, "bench " + o.name, failure);
    return std::nullopt;
  }
  if (o.experts < 1 || o.experts % std::max(o.gpus, 1) != 0)
    fail("bench " + o.name, "--experts ", o.experts, " must be a positive multiple of --gpus ", o.gpus);
  const WorkerInfo info = worker_from_env();
  log::set_identity(info.rank, info.local_rank);
  Communicator comm(info, exchange_unique_id(info), info.local_rank);
  const EpBenchOptions ep{transport, o.sms, o.experts, capacity, o.ranks_per_node};
  std::vector<BenchRow> rows = b.across_gpus(BenchRun{o, opts, &comm, &ep});
  if (info.rank != 0) return std::nullopt;
  return rows;
#else
  (void)b;
  (void)opts;
  no_nccl(o.name);
#endif
}

// Prints the rows as a table and writes them (--json) and merges them (--record).
void write_rows(const BenchCommandOptions& o, const std::vector<BenchRow>& rows) {
  std::string commit = o.commit;
  if (commit.empty()) commit = env::commit();
  if (commit.empty()) commit = MOERAIL_BUILD_COMMIT;
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : rows) out.push_back(to_json(r, commit, today()));

  std::printf("%-10s %-16s %-5s %12s %12s %-8s %12s %7s %14s\n", "bench", "case", "dir", "time_us", "value",
              "metric", "ceiling", "share", "baseline");
  for (const auto& r : rows) {
    const double share = r.ceiling && r.ceiling->value > 0 ? 100.0 * r.value / r.ceiling->value : 0.0;
    std::printf("%-10s %-16s %-5s %12.1f %12.1f %-8s %12.1f %6.1f%% %14s\n", r.bench.c_str(), r.case_name.c_str(),
                r.direction.c_str(), r.time_us, r.value, r.metric.c_str(), r.ceiling ? r.ceiling->value : 0.0, share,
                r.baseline ? std::to_string(r.baseline->value).c_str() : "-");
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    if (!f) fail("bench", "--json: cannot write ", o.json);
    f << out.dump(2) << "\n";
  }
  if (!o.record_dir.empty() && !rows.empty()) {
    std::filesystem::create_directories(o.record_dir);
    const std::string path = o.record_dir + "/" + short_gpu_name(rows.front().gpu) + "-x" +
                             std::to_string(rows.front().gpus) + ".json";
    merge_into(path, out);
    std::printf("recorded %zu rows in %s\n", rows.size(), path.c_str());
  }
}

}  // namespace

std::span<const BenchEntry> benches() { return kBenches; }

const BenchEntry* find_bench(std::string_view name) {
  for (const BenchEntry& b : kBenches)
    if (b.name == name) return &b;
  return nullptr;
}

std::string bench_names(std::string_view separator) {
  std::string s;
  for (const BenchEntry& b : kBenches) s += (s.empty() ? "" : std::string(separator)) + std::string(b.name);
  return s;
}

std::string bench_help() {
  std::string s;
  for (const BenchEntry& b : kBenches) {
    const std::string name(b.name);
    s += "  " + name + std::string(name.size() < 14 ? 14 - name.size() : 1, ' ') + std::string(b.help) + "\n";
  }
  return s;
}

int bench_command(const BenchCommandOptions& o) {
  const BenchEntry* bench = find_bench(o.name);
  if (!bench) fail("bench", "unknown benchmark '", o.name, "' (known: ", bench_names(", "), ")");
  BenchOptions opts = o.bench;
  if (opts.case_name.empty()) opts.case_name = opts.config;
  std::vector<BenchRow> rows;
  if (runs_across_gpus(*bench, o)) {
    std::optional<std::vector<BenchRow>> mine = run_across_gpus(*bench, o, opts);
    if (!mine) return 0;  // the spawning process, or a rank other than 0
    rows = std::move(*mine);
  } else {
    rows = bench->one_gpu(BenchRun{o, opts});
  }
  write_rows(o, rows);
  return 0;
}

}  // namespace moerail::tools
