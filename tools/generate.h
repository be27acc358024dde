// Sampling from a trained model: the `generate` executable (generate_main.cpp).
//
//   generate <checkpoint> [--tokenizer PATH] --prompt TEXT [options]
//   generate --config <train TOML> [<checkpoint>] --prompt TEXT [options]
//
// <checkpoint>: any form open_model reads (a ctitan or DCP step folder, a checkpoint folder of
// step-<N> folders — its newest complete step —, a Hugging Face folder, a consolidated .pt).
// With --config the checkpoint defaults to <job.dump_folder>/<checkpoint.folder> and the
// tokenizer to the run's (model.tokenizer_path / model.hf_assets_path), the sequence limit to
// training.seq_len; an HF folder holding a tokenizer.json is its own tokenizer.
//
// The prompt is encoded with BOS (as training framed documents), run once through the model
// (prefill), then one token at a time through the KV cache (models/*: forward_cached);
// each new token is chosen by sample_token and its text streamed to stdout as soon as it is
// complete UTF-8. Stops at the tokenizer's EOS (not printed), after --max-new-tokens, or at the
// sequence limit. The last line on stderr gives tokens/s. Exit 0; 2 for bad input (a missing
// checkpoint, an unknown option, a prompt longer than the sequence limit); 1 for failures.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/Tensor.h>

#include "tools/inference_model.h"

namespace ctitan {

struct SamplingOptions {
  double temperature = 0;  // 0: greedy (argmax); else logits / temperature, then sampled
  int64_t top_k = 0;       // > 0: only the k most likely tokens may be drawn
  double top_p = 1.0;      // < 1: only the smallest set of most likely tokens whose
                           // probabilities sum to >= top_p (nucleus) may be drawn
};

// The next token from logits float [V]: argmax for temperature 0 (the first maximum, as
// torch.argmax); else temperature, then top-k, then top-p (the order of transformers'
// logits warpers), then one draw from `gen` (torch::multinomial).
int64_t sample_token(const at::Tensor& logits, const SamplingOptions& o, at::Generator& gen);

struct GenerateResult {
  std::vector<int64_t> prompt, generated;  // generated excludes a final EOS
  std::string stop;                        // "eos" | "max_new_tokens" | "max_seq_len"
  double prefill_s = 0, decode_s = 0;      // wall time of the prompt pass / of the rest
};

// Generates from `prompt` (ids) with `model`'s KV cache; on_token(id) is called for every new
// token as it is chosen (EOS included). eos_id < 0: no EOS stop. The cache holds up to
// model.max_seq_len positions.
GenerateResult generate_tokens(const InferenceModel& model, const std::vector<int64_t>& prompt, int64_t max_new_tokens,
                               const SamplingOptions& sampling, uint64_t seed, int64_t eos_id,
                               const std::function<void(int64_t)>& on_token);

// argv-style entry point; returns the exit code.
int generate_main(const std::vector<std::string>& args);

}  // namespace ctitan
