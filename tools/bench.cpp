// `moerail bench <name>`: runs one benchmark, prints its rows as a table, writes/merges them as JSON.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>

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

int bench_command(const BenchCommandOptions& o) {
  BenchOptions opts = o.bench;
  if (opts.case_name.empty()) opts.case_name = opts.config;
  std::vector<BenchRow> rows;
  const bool ep = o.name == "dispatch" || o.name == "dispatch-fp8" || o.name == "layer" ||
                  (o.name == "combine" && o.gpus > 0);
  if (ep) {
#if MOERAIL_WITH_NCCL
    const Transport transport = parse_transport(o.transport, "--transport");
    if (std::getenv("MOERAIL_WORLD_SIZE") == nullptr && o.gpus > 1) {
      SpawnOptions so;
      so.rendezvous = o.rendezvous;
      so.nnodes = o.nnodes;
      so.node_rank = o.node_rank;
      const std::string failure = spawn_local_workers(o.gpus, o.argv, so);
      if (!failure.empty()) fail_with(ErrorCode::System, "bench " + o.name, failure);
      return 0;
    }
    if (o.experts < 1 || o.experts % std::max(o.gpus, 1) != 0)
      fail("bench " + o.name, "--experts ", o.experts, " must be a positive multiple of --gpus ", o.gpus);
    const WorkerInfo info = worker_from_env();
    log::set_identity(info.rank, info.local_rank);
    Communicator comm(info, exchange_unique_id(info), info.local_rank);
    if (o.name == "layer") {
      std::vector<long long> tokens{512, 1024, 2048, 4096, 8192, 16384};
      if (opts.tokens > 0) tokens = {opts.tokens};
      rows = run_layer_bench(opts, o.layer, comm, EpBenchOptions{transport, o.sms, o.experts}, tokens);
    } else {
      rows = run_ep_bench(o.name, opts, comm, EpBenchOptions{transport, o.sms, o.experts});
    }
    if (info.rank != 0) return 0;  // rank 0 prints and writes
#else
    fail_with(ErrorCode::Unsupported, "bench " + o.name, "this build has no NCCL (multi-GPU ops left out)");
#endif
  } else if (o.name == "mlp")
    rows = run_mlp_bench(opts);
  else if (o.name == "mlp-fp8")
    rows = run_mlp_fp8_bench(opts);
  else if (o.name == "router" || o.name == "permute" || o.name == "combine")
    rows = run_kernel_bench(o.name, opts);
  else
    fail("bench", "unknown benchmark '", o.name,
         "' (known: router, permute, combine, dispatch, dispatch-fp8, mlp, mlp-fp8, layer)");

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
  return 0;
}

}  // namespace moerail::tools
