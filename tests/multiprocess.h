// Multi-process tests that spawn their own ranks: the test executable re-executes itself
// (posix_spawn of /proc/self/exe) once per rank with CTITAN_TEST_CHILD=<name> and the
// launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT); main() then runs the registered child function instead of the tests.
//
//   CTITAN_CHILD(all_gather) { ...; return 0; }           // runs in every rank
//   TEST(X, Y) { auto r = spawn_ranks("all_gather", 4); EXPECT_EQ(r[0].exit_code, 0); }
//   CTITAN_MULTIPROCESS_MAIN()                            // once per test file
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

extern char** environ;

namespace ctitan::testing {

inline std::map<std::string, std::function<int()>>& child_registry() {
  static std::map<std::string, std::function<int()>> r;
  return r;
}

struct RankResult {
  int exit_code = -1;  // exit status, or 128 + signal
  bool timed_out = false;
  std::string output;  // stdout + stderr
};

// A TCP port that was free a moment ago (bind to port 0 and read it back).
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Spawns `argv` (argv[0] = program) n times as ranks 0..n-1 and waits for all of them,
// killing every rank still alive after timeout_s. `env` entries override the inherited
// environment for every rank.
inline std::vector<RankResult> spawn_processes(const std::vector<std::string>& argv, int n,
                                               std::map<std::string, std::string> env = {}, int timeout_s = 120) {
  const int port = free_port();
  std::vector<pid_t> pids(n, -1);
  std::vector<std::string> logs(n);
  char dir_tmpl[] = "/tmp/ctitan_ranks_XXXXXX";
  const std::string dir = mkdtemp(dir_tmpl);
  for (int r = 0; r < n; ++r) {
    std::map<std::string, std::string> e;
    for (char** p = environ; p && *p; ++p) {
      std::string kv(*p);
      auto eq = kv.find('=');
      if (eq != std::string::npos) e[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    e["RANK"] = std::to_string(r);
    e["LOCAL_RANK"] = std::to_string(r);
    e["WORLD_SIZE"] = std::to_string(n);
    e["LOCAL_WORLD_SIZE"] = std::to_string(n);
    e["MASTER_ADDR"] = "127.0.0.1";
    e["MASTER_PORT"] = std::to_string(port);
    e["OMP_NUM_THREADS"] = "1";
    for (auto& [k, v] : env) e[k] = v;
    std::vector<std::string> env_strs;
    for (auto& [k, v] : e) env_strs.push_back(k + "=" + v);
    std::vector<char*> envp, args;
    for (auto& s : env_strs) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (auto& s : argv_copy) args.push_back(s.data());
    args.push_back(nullptr);
    logs[r] = dir + "/rank" + std::to_string(r) + ".log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    posix_spawn_file_actions_addclose(&fa, 0);
    if (posix_spawn(&pids[r], args[0], &fa, nullptr, args.data(), envp.data()) != 0) pids[r] = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  std::vector<RankResult> res(n);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int alive = 0;
  for (auto p : pids) alive += p > 0;
  while (alive > 0) {
    for (int r = 0; r < n; ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        res[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pids[r] = -1;
        --alive;
      }
    }
    if (alive == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r)
        if (pids[r] > 0) {
          kill(pids[r], SIGKILL);
          int status = 0;
          waitpid(pids[r], &status, 0);
          res[r].timed_out = true;
          res[r].exit_code = 128 + SIGKILL;
          pids[r] = -1;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < n; ++r) {
    res[r].output = read_file(logs[r]);
    std::remove(logs[r].c_str());
  }
  rmdir(dir.c_str());
  return res;
}

// Runs the registered child `name` in n ranks of this very executable.
inline std::vector<RankResult> spawn_ranks(const std::string& name, int n, std::map<std::string, std::string> env = {},
                                           int timeout_s = 120) {
  env["CTITAN_TEST_CHILD"] = name;
  return spawn_processes({"/proc/self/exe"}, n, env, timeout_s);
}

// All ranks exited 0; otherwise a message with every rank's output.
inline ::testing::AssertionResult all_ok(const std::vector<RankResult>& rs) {
  bool ok = true;
  std::string msg;
  for (size_t r = 0; r < rs.size(); ++r) {
    if (rs[r].exit_code != 0) ok = false;
    msg += "--- rank " + std::to_string(r) + " exit " + std::to_string(rs[r].exit_code) +
           (rs[r].timed_out ? " (timed out)" : "") + "\n" + rs[r].output;
  }
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg;
}

inline int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

}  // namespace ctitan::testing

#define CTITAN_CHILD(name)                                                      \
  static int ctitan_child_##name();                                             \
  static const bool ctitan_child_reg_##name =                                   \
      (::ctitan::testing::child_registry()[#name] = ctitan_child_##name, true); \
  static int ctitan_child_##name()

#define CTITAN_MULTIPROCESS_MAIN()                                             \
  int main(int argc, char** argv) {                                            \
    if (const char* child = std::getenv("CTITAN_TEST_CHILD")) {                \
      auto& reg = ::ctitan::testing::child_registry();                         \
      auto it = reg.find(child);                                               \
      if (it == reg.end()) {                                                   \
        std::cerr << "unknown child " << child << std::endl;                   \
        return 99;                                                             \
      }                                                                        \
      /* As train_main does: a write to a dead peer's socket is an error */    \
      /* Gloo reports (EPIPE), not a silent SIGPIPE death (exit 141). */       \
      signal(SIGPIPE, SIG_IGN);                                                \
      try {                                                                    \
        return it->second();                                                   \
      } catch (const std::exception& e) {                                      \
        std::cerr << "child " << child << " threw: " << e.what() << std::endl; \
        return 98;                                                             \
      }                                                                        \
    }                                                                          \
    ::testing::InitGoogleTest(&argc, argv);                                    \
    return RUN_ALL_TESTS();                                                    \
  }
