// Data pipeline alone (bench/perf.sh table 4): tokens/s that ctitan's DataLoader delivers —
// reading the text, tokenizing with sentencepiece and packing windows — with no model.
//
//   dataloader_bench <tokenizer.model> <text file or folder> <seq_len> <batch> <seconds>
//
// Prints one JSON line: {"tokens_per_s":..., "batches":..., "epochs":...}.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "datasets/dataloader.h"
#include "datasets/tokenizer.h"

int main(int argc, char** argv) {
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
