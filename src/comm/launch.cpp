// Bootstrap of a process group (include/moerail/comm.h): the worker environment, the unique id handed over through
// a rendezvous directory, and the local launcher behind `moerail run|bench --gpus N`.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "moerail/comm.h"
#include "moerail/error.h"

namespace moerail {
namespace {

namespace fs = std::filesystem;
constexpr const char* kIdFile = "moerail.ncclid";

int env_int(const char* name, int fallback, int lo) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != 0 || x < lo || x > 1 << 20) fail("environment", name, "=\"", v, "\" (expected an integer >= ", lo, ")");
  return int(x);
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return detail::concat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return detail::concat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return "ended abnormally";
}

}  // namespace

WorkerInfo worker_from_env() {
  WorkerInfo w;
  w.world_size = env_int("MOERAIL_WORLD_SIZE", 1, 1);
  w.rank = env_int("MOERAIL_RANK", 0, 0);
  w.local_rank = env_int("MOERAIL_LOCAL_RANK", w.rank, 0);
  if (w.rank >= w.world_size)
    fail("environment", "MOERAIL_RANK=", w.rank, " but MOERAIL_WORLD_SIZE=", w.world_size, " (expected rank < size)");
  if (const char* d = std::getenv("MOERAIL_RENDEZVOUS")) w.rendezvous = d;
  if (w.world_size > 1 && w.rendezvous.empty())
    fail("environment", "MOERAIL_WORLD_SIZE=", w.world_size, " needs MOERAIL_RENDEZVOUS (a directory all ranks see)");
  return w;
}

void publish_unique_id(const std::string& dir, const UniqueId& id) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const fs::path tmp = fs::path(dir) / detail::concat(kIdFile, ".tmp.", ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(id.bytes.data(), std::streamsize(id.bytes.size()));
    if (!f) fail_with(ErrorCode::System, "rendezvous", "cannot write ", tmp.string());
  }
  fs::rename(tmp, fs::path(dir) / kIdFile, ec);  // atomic: readers see all of it or nothing
  if (ec) fail_with(ErrorCode::System, "rendezvous", "cannot publish the id in ", dir, ": ", ec.message());
}

UniqueId wait_unique_id(const std::string& dir, double timeout_s) {
  const fs::path path = fs::path(dir) / kIdFile;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    std::ifstream f(path, std::ios::binary);
    UniqueId id;
    if (f.read(id.bytes.data(), std::streamsize(id.bytes.size()))) return id;
    if (std::chrono::steady_clock::now() > deadline)
      fail_with(ErrorCode::Timeout, "rendezvous", "no id from rank 0 in ", path.string(), " after ", timeout_s,
                " s (is rank 0 running and is the directory shared?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

UniqueId exchange_unique_id(const WorkerInfo& info, double timeout_s) {
  if (info.world_size == 1) return new_unique_id();
  if (info.rank == 0) {
    const UniqueId id = new_unique_id();
    publish_unique_id(info.rendezvous, id);
    return id;
  }
  return wait_unique_id(info.rendezvous, timeout_s);
}

std::string spawn_local_workers(int n, const std::vector<std::string>& argv, const SpawnOptions& opts) {
  if (n < 1) fail("--gpus", "got ", n, " (expected >= 1)");
  if (argv.empty()) fail("spawn_local_workers", "argv is empty");
  if (opts.nnodes < 1 || opts.node_rank < 0 || opts.node_rank >= opts.nnodes)
    fail("--node-rank", "got ", opts.node_rank, " with --nnodes ", opts.nnodes, " (expected 0 <= node rank < nnodes)");
  if (opts.nnodes > 1 && opts.rendezvous.empty())
    fail("--rendezvous", "several nodes need a rendezvous directory that every node sees");
  std::string dir = opts.rendezvous;
  bool remove_dir = false;
  if (dir.empty()) {
    std::string templ = (fs::temp_directory_path() / "moerail-rdv-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) fail_with(ErrorCode::System, "spawn", "mkdtemp failed");
    dir = templ;
    remove_dir = true;
  } else if (opts.node_rank == 0) {
    std::error_code ec;
    fs::remove(fs::path(dir) / kIdFile, ec);  // a stale id from an earlier run would split the group
  }

  std::vector<pid_t> pids(std::size_t(n), -1);
  for (int i = 0; i < n; ++i) {
    const pid_t pid = ::fork();
    if (pid < 0) fail_with(ErrorCode::System, "spawn", "fork failed for local rank ", i);
    if (pid == 0) {
      ::setenv("MOERAIL_RANK", std::to_string(opts.node_rank * n + i).c_str(), 1);
      ::setenv("MOERAIL_WORLD_SIZE", std::to_string(opts.nnodes * n).c_str(), 1);
      ::setenv("MOERAIL_LOCAL_RANK", std::to_string(i).c_str(), 1);
      ::setenv("MOERAIL_RENDEZVOUS", dir.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    pids[std::size_t(i)] = pid;
  }

  std::string failure;
  int alive = n;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (alive > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, failure.empty() ? 0 : WNOHANG);
    if (pid > 0) {
      for (int i = 0; i < n; ++i) {
        if (pids[std::size_t(i)] != pid) continue;
        pids[std::size_t(i)] = -1;
        --alive;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failure.empty()) {
          failure = detail::concat("rank ", opts.node_rank * n + i, " ", describe_exit(status),
                                   "; the other ranks were stopped");
          for (pid_t p : pids)
            if (p > 0) ::kill(p, SIGTERM);
          deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                            std::chrono::duration<double>(opts.grace_s));
        }
      }
    } else if (pid < 0) {
      break;
    } else {
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t p : pids)
          if (p > 0) ::kill(p, SIGKILL);
        deadline = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (remove_dir) {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  return failure;
}

}  // namespace moerail
