// Data pipeline alone (bench/perf.sh table 4): tokens/s that ctitan's DataLoader delivers —
// reading the text, tokenizing with sentencepiece and packing windows — with no model.
//
//   dataloader_bench <tokenizer.model> <text file or folder> <seq_len> <batch> <seconds>
//
// Prints one JSON line: {"tokens_per_s":..., "batches":..., "epochs":...}.
//
//   dataloader_bench scan <corpus> <dp_rank> <dp_world> [ranges|interleaved]
//
// (bench/data_sharding.sh) reads and parses every document of one rank's share of one pass,
// without tokenizing: "ranges" as the loader shards (datasets/sharding.h), "interleaved" as
// builds before it did (the whole stream, keeping documents rank, rank+W, ...). Prints
// {"rank":..., "documents":..., "bytes_parsed":..., "rchar":..., "seconds":...}; rchar is
// /proc/self/io's count of bytes this process read.
//
//   dataloader_bench json <file.jsonl> [repeats]
//
// (bench/json_parsers.sh) the JSONL record parse the loader does per document, with ctitan's
// parser (util/json.h) and with nlohmann-json (Debian's nlohmann-json3-dev), over the same
// lines, best of `repeats`: checks both extract the same "text" and prints
// {"lines":..., "bytes":..., "ctitan_s":..., "nlohmann_s":..., "nlohmann_over_ctitan":...}.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "datasets/dataloader.h"
#include "datasets/sharding.h"
#include "datasets/text_source.h"
#include "datasets/tokenizer.h"
#include "util/json.h"

#include <nlohmann/json.hpp>

namespace {

long long rchar() {
  std::ifstream io("/proc/self/io");
  std::string k;
  long long v = 0;
  while (io >> k >> v)
    if (k == "rchar:") return v;
  return -1;
}

int scan(const std::string& source, int64_t rank, int64_t world, bool interleaved) {
  const auto t0 = std::chrono::steady_clock::now();
  const long long r0 = rchar();
  ctitan::DocumentReader reader(source);
  std::vector<ctitan::SourceFile> files;
  for (const auto& path : reader.files()) {
    ctitan::SourceFile f;
    f.name = std::filesystem::path(path).filename().string();
    f.extent = std::filesystem::file_size(path);
    f.splittable = path.size() < 3 || path.compare(path.size() - 3, 3, ".gz") != 0;
    files.push_back(f);
  }
  std::vector<ctitan::WorkUnit> work;
  if (interleaved)
    work.push_back({0, 0, ctitan::WorkUnit::kToEnd, world, rank, 0, true});
  else
    work = ctitan::plan_pass(files, rank, world);
  long long docs = 0;
  ctitan::Document d;
  for (auto& u : work) {
    reader.set_range(u.file, u.begin, u.end, u.chain);
    while (reader.next(&d)) docs += u.ordinal++ % u.stride == u.phase;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"rank\": %lld, \"documents\": %lld, \"bytes_parsed\": %llu, \"rchar\": %lld, \"seconds\": %.2f}\n",
              static_cast<long long>(rank), docs, static_cast<unsigned long long>(reader.bytes_read()), rchar() - r0,
              s);
  return 0;
}

// Seconds to parse every line and take its "text" (summing the lengths, so nothing is
// optimised away).
template <class Parse>
double time_parse(const std::vector<std::string>& lines, Parse parse, size_t* total) {
  const auto t0 = std::chrono::steady_clock::now();
  size_t n = 0;
  for (const auto& l : lines) n += parse(l).size();
  *total = n;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int json_compare(const std::string& path, int repeats) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  size_t bytes = 0;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) bytes += l.size(), lines.push_back(std::move(l));
  auto ours = [](const std::string& l) {
    ctitan::json::Value v;
    std::string err;
    if (!ctitan::json::parse(l, &v, &err)) throw std::runtime_error("ctitan json: " + err);
    const auto* t = v.find("text");
    return t ? t->text : std::string();
  };
  auto theirs = [](const std::string& l) { return nlohmann::json::parse(l).value("text", std::string()); };
  for (size_t i = 0; i < lines.size(); i += 97)
    if (ours(lines[i]) != theirs(lines[i]))
      throw std::runtime_error("the parsers disagree on line " + std::to_string(i + 1));
  double best_ours = 1e30, best_theirs = 1e30;
  size_t n_ours = 0, n_theirs = 0;
  for (int r = 0; r < repeats; ++r) {  // alternating, best of each
    best_ours = std::min(best_ours, time_parse(lines, ours, &n_ours));
    best_theirs = std::min(best_theirs, time_parse(lines, theirs, &n_theirs));
  }
  if (n_ours != n_theirs) throw std::runtime_error("the parsers extracted different amounts of text");
  std::printf(
      "{\"lines\": %zu, \"bytes\": %zu, \"ctitan_s\": %.3f, \"nlohmann_s\": %.3f, \"nlohmann_over_ctitan\": %.2f}\n",
      lines.size(), bytes, best_ours, best_theirs, best_theirs / best_ours);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "json") {
    try {
      return json_compare(argv[2], argc > 3 ? std::atoi(argv[3]) : 3);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dataloader_bench: %s\n", e.what());
      return 1;
    }
  }
  if (argc >= 5 && std::string(argv[1]) == "scan") {
    try {
      return scan(argv[2], std::atoll(argv[3]), std::atoll(argv[4]), argc > 5 && std::string(argv[5]) == "interleaved");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dataloader_bench: %s\n", e.what());
      return 1;
    }
  }
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s <tokenizer.model> <text> <seq_len> <batch> <seconds>\n", argv[0]);
    return 2;
  }
  try {
    const auto tok = ctitan::Tokenizer::load(argv[1]);
    const int64_t seq = std::atoll(argv[3]), batch = std::atoll(argv[4]);
    const double seconds = std::atof(argv[5]);
    ctitan::DataLoader loader(*tok, argv[2], seq, batch, /*dp_rank=*/0, /*dp_world=*/1);
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    int64_t batches = 0, tokens = 0;
    double elapsed = 0;
    while (elapsed < seconds) {
      const auto b = loader.next();
      tokens += b.batch * b.seq;
      ++batches;
      elapsed = std::chrono::duration<double>(clock::now() - t0).count();
    }
    std::printf("{\"tokens_per_s\": %.1f, \"batches\": %lld, \"epochs\": %lld}\n", tokens / elapsed,
                static_cast<long long>(batches), static_cast<long long>(loader.epoch()));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dataloader_bench: %s\n", e.what());
    return 1;
  }
}
