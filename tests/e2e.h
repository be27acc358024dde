// Helpers for tests that drive the real executables: run a shell command, generate a
// small corpus, read a field out of metrics.jsonl.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

namespace ctitan::testing {

inline const std::string kTrain = CTITAN_TRAIN_BIN;
inline const std::string kSrc = CTITAN_SOURCE_DIR;

struct Cmd {
  int code;         // exit status, or 128 + signal
  std::string out;  // stdout and stderr
};

inline Cmd sh(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// A small corpus of generated English-like paragraphs: a fixed grammar over a fixed
// vocabulary, so there is structure to learn and the loss can fall within 20 steps.
// Writes <dir>/corpus.txt and returns its path.
inline std::string make_corpus(const std::filesystem::path& dir) {
  const char* subj[] = {"the whale", "the captain", "a sailor", "the harpooneer", "the mate", "the ship"};
  const char* verb[] = {"watched", "followed", "feared", "sought", "sailed past", "remembered"};
  const char* obj[] = {"the white sea",   "a distant spout",   "the old chart",
                       "the long voyage", "the quiet harbour", "the heavy storm"};
  const char* tail[] = {"at dawn.", "before the storm.", "in silence.", "for many days.", "with great care."};
  std::mt19937 rng(1234);
  std::filesystem::create_directories(dir);
  const auto path = dir / "corpus.txt";
  std::ofstream f(path);
  for (int para = 0; para < 400; ++para) {
    const int sentences = 2 + rng() % 4;
    for (int s = 0; s < sentences; ++s)
      f << (s ? " " : "") << subj[rng() % 6] << " " << verb[rng() % 6] << " " << obj[rng() % 6] << " "
        << tail[rng() % 5];
    f << "\n\n";
  }
  return path.string();
}

// The values of `field` in every line of a metrics.jsonl, as printed (17 digits).
inline std::vector<std::string> jsonl_field(const std::string& path, const std::string& field) {
  std::ifstream f(path);
  std::string line;
  std::vector<std::string> out;
  const std::regex re("\"" + field + "\": ([^,}]+)");
  while (std::getline(f, line)) {
    std::smatch m;
    if (std::regex_search(line, m, re)) out.push_back(m[1]);
  }
  return out;
}

}  // namespace ctitan::testing
