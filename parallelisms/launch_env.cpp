#include "parallelisms/launch_env.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include "config/errors.h"

extern char** environ;

namespace ctitan {
namespace {

using Env = std::map<std::string, std::string>;

const std::string* find(const Env& env, const std::string& key) {
  auto it = env.find(key);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

int64_t as_int(const Env& env, const std::string& key, int64_t min_value) {
  const std::string* v = find(env, key);
  if (!v) throw UserError("launch: environment variable " + key + " is not set");
  char* end = nullptr;
  const long long x = std::strtoll(v->c_str(), &end, 10);
  if (end == v->c_str() || *end != '\0' || x < min_value)
    throw UserError("launch: " + key + "=" + *v + " is not an integer >= " + std::to_string(min_value));
  return x;
}

// Slurm's compressed list of tasks per node ("3(x2),2": 3 on nodes 0 and 1, 2 on node 2):
// the entry of `node`.
int64_t slurm_tasks_on_node(const std::string& list, int64_t node) {
  std::stringstream ss(list);
  int64_t first = 0;
  for (std::string item; std::getline(ss, item, ',');) {
    char* end = nullptr;
    const long long tasks = std::strtoll(item.c_str(), &end, 10);
    long long repeat = 1;
    if (end && *end == '(' && std::sscanf(end, "(x%lld)", &repeat) != 1) repeat = -1;
    if (end == item.c_str() || tasks < 1 || repeat < 1)
      throw UserError("launch: SLURM_STEP_TASKS_PER_NODE=" + list + " is not a Slurm task list");
    if (node < first + repeat) return tasks;
    first += repeat;
  }
  throw UserError("launch: SLURM_STEP_TASKS_PER_NODE=" + list + " has no entry for node " + std::to_string(node));
}

}  // namespace

std::map<std::string, std::string> environment_map() {
  Env env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv(*e);
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

LaunchEnv detect_launch_env(const Env& env) {
  LaunchEnv le;
  if (find(env, "RANK") || find(env, "WORLD_SIZE")) {
    // torchrun, torchrun --no-python, scripts/run_train.sh.
    le.launcher = "torchrun";
    le.rank = as_int(env, "RANK", 0);
    le.world_size = as_int(env, "WORLD_SIZE", 1);
    le.local_rank = find(env, "LOCAL_RANK") ? as_int(env, "LOCAL_RANK", 0) : le.rank;
    le.local_world_size = find(env, "LOCAL_WORLD_SIZE") ? as_int(env, "LOCAL_WORLD_SIZE", 1) : le.world_size;
    // torchrun: the elastic agent's additions (absent under scripts/run_train.sh).
    if (const std::string* id = find(env, "TORCHELASTIC_RUN_ID")) le.run_id = *id;
    if (find(env, "TORCHELASTIC_RESTART_COUNT")) le.restart_count = as_int(env, "TORCHELASTIC_RESTART_COUNT", 0);
    if (find(env, "TORCHELASTIC_MAX_RESTARTS")) le.max_restarts = as_int(env, "TORCHELASTIC_MAX_RESTARTS", 0);
    if (const std::string* f = find(env, "TORCHELASTIC_ERROR_FILE")) le.error_file = *f;
    // torchrun writes str(True) / str(False) (Python's spelling).
    if (const std::string* a = find(env, "TORCHELASTIC_USE_AGENT_STORE")) le.agent_store = *a == "True";
  } else if (find(env, "OMPI_COMM_WORLD_RANK")) {
    le.launcher = "mpirun";
    le.rank = as_int(env, "OMPI_COMM_WORLD_RANK", 0);
    le.world_size = as_int(env, "OMPI_COMM_WORLD_SIZE", 1);
    le.local_rank = as_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    le.local_world_size =
        find(env, "OMPI_COMM_WORLD_LOCAL_SIZE") ? as_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1) : le.world_size;
  } else if (find(env, "SLURM_PROCID")) {
    le.launcher = "srun";
    le.rank = as_int(env, "SLURM_PROCID", 0);
    le.world_size = as_int(env, "SLURM_NTASKS", 1);
    le.local_rank = find(env, "SLURM_LOCALID") ? as_int(env, "SLURM_LOCALID", 0) : 0;
    if (find(env, "SLURM_NTASKS_PER_NODE")) {
      le.local_world_size = as_int(env, "SLURM_NTASKS_PER_NODE", 1);
    } else if (const std::string* per_node = find(env, "SLURM_STEP_TASKS_PER_NODE")) {
      // srun -n N without --ntasks-per-node: this node's entry of e.g. "3(x2),2".
      const int64_t node = find(env, "SLURM_NODEID") ? as_int(env, "SLURM_NODEID", 0) : 0;
      le.local_world_size = slurm_tasks_on_node(*per_node, node);
    } else {
      le.local_world_size = le.world_size;
    }
  } else {
    return le;  // no launcher: a single process
  }
  if (le.rank >= le.world_size)
    throw UserError("launch: rank " + std::to_string(le.rank) + " (" + le.launcher + ") is not below the world size " +
                    std::to_string(le.world_size));
  if (le.local_rank >= le.local_world_size)
    throw UserError("launch: local rank " + std::to_string(le.local_rank) + " is not below the local world size " +
                    std::to_string(le.local_world_size));

  if (const std::string* a = find(env, "MASTER_ADDR")) {
    le.master_addr = *a;
  } else if (le.world_size > le.local_world_size) {
    // Several nodes and nobody said where rank 0 listens.
    throw UserError("launch: " + le.launcher + " with " + std::to_string(le.world_size) +
                    " ranks on several nodes needs MASTER_ADDR (the address of rank 0's node)");
  }
  if (find(env, "MASTER_PORT")) {
    const int64_t p = as_int(env, "MASTER_PORT", 1);
    if (p > 65535) throw UserError("launch: MASTER_PORT=" + std::to_string(p) + " is not a TCP port");
    le.master_port = static_cast<int>(p);
  } else if (le.launcher != "torchrun") {
    // mpirun/srun: derive a port from the job id so that concurrent jobs rarely collide.
    const std::string* job = find(env, "SLURM_JOB_ID");
    le.master_port = 29500 + (job ? static_cast<int>(std::strtol(job->c_str(), nullptr, 10) % 1000) : 0);
  } else {
    throw UserError("launch: RANK is set but MASTER_PORT is not");
  }
  return le;
}

namespace {
// A JSON string literal of s: quotes, backslashes and control characters escaped.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}
}  // namespace

std::string torchelastic_error_json(const std::string& line, int64_t unix_seconds) {
  return "{\"message\": {\"message\": " + json_string(line) + ", \"extraInfo\": {\"timestamp\": \"" +
         std::to_string(unix_seconds) + "\"}}}";
}

void maybe_write_torchelastic_error(const std::string& line, bool consequence) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return;
  if (consequence) std::this_thread::sleep_for(std::chrono::seconds(1));
  std::ofstream f(path, std::ios::trunc);
  f << torchelastic_error_json(line, static_cast<int64_t>(std::time(nullptr))) << "\n";
}

void exit_when_agent_dies(const LaunchEnv& env) {
  if (!env.elastic()) return;
  const pid_t agent = getppid();
  std::thread([agent, rank = env.rank] {
    while (getppid() == agent) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const std::string line = "error: rank " + std::to_string(rank) + ": the torchrun agent that started it (pid " +
                             std::to_string(agent) + ") is gone; stopping so that the job can restart without it";
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
    maybe_write_torchelastic_error(line);
    std::_Exit(1);
  }).detach();
}

}  // namespace ctitan
