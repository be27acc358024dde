// Tokenizer encode speed, one thread (bench/tokenizer_bench.sh puts it beside Hugging Face
// `tokenizers` on the same documents).
//
//   tokenizer_bench <tokenizer file or hf_assets folder> <text file or folder> [passes=3]
//
// Reads every document of the source with ctitan's reader, then encodes all of them `passes`
// times, each document as the dataloader does (encode(text, bos=true, eos=true)). The first
// pass starts with an empty pre-token cache (cold); the best pass is reported as the steady
// state. Prints one JSON line: {"docs", "bytes", "tokens", "cold_tokens_per_s",
// "tokens_per_s", "cache_entries"}.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "datasets/hf_tokenizer.h"
#include "datasets/text_source.h"
#include "datasets/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: %s <tokenizer file or hf_assets folder> <text> [passes=3]\n", argv[0]);
    return 2;
  }
  try {
    std::string path = argv[1];
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) path = ctitan::resolve_tokenizer_path("", path);
    const auto tok = ctitan::Tokenizer::load(path);
    const int passes = argc == 4 ? std::max(1, std::atoi(argv[3])) : 3;

    std::vector<std::string> docs;
    size_t bytes = 0;
    ctitan::DocumentReader reader(argv[2]);
    for (ctitan::Document d; reader.next(&d);) {
      bytes += d.text.size();
      docs.push_back(std::move(d.text));
    }
    using clock = std::chrono::steady_clock;
    double cold = 0, best = 0;
    int64_t tokens = 0;
    for (int p = 0; p < passes; ++p) {
      int64_t n = 0;
      const auto t0 = clock::now();
      for (const auto& text : docs) n += static_cast<int64_t>(tok->encode(text, true, true).size());
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      const double rate = static_cast<double>(n) / s;
      if (p == 0) cold = rate;
      best = std::max(best, rate);
      tokens = n;
    }
    const auto* hf = dynamic_cast<const ctitan::HfTokenizer*>(tok.get());
    std::printf(
        "{\"docs\": %zu, \"bytes\": %zu, \"tokens\": %lld, \"cold_tokens_per_s\": %.1f, "
        "\"tokens_per_s\": %.1f, \"cache_entries\": %zu}\n",
        docs.size(), bytes, static_cast<long long>(tokens), cold, best, hf ? hf->cache_size() : 0);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", e.what());
    return 1;
  }
}
