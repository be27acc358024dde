// A model family behind one seam (torchtitan's TrainSpec): its flavors, how it is built for
// training and for inference, how it is parallelised, its sizes, its step hooks (in
// TrainModel: StepHooks) and its Hugging Face adapter. Code outside models/ looks a family up by model.name (models/registry.h) and never
// names one.
//
// Adding a family: a folder models/<family>/ with its args, flavors and a
// `ModelSpec <family>_spec()`, plus one line in models/registry.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "hf_types/hf_config.h"
#include "models/decoder_args.h"
#include "models/layers.h"
#include "models/train_model.h"

namespace ctitan {

// A flavor's sizes at a sequence length, from its args alone (nothing allocated): what the
// start-up line, MFU and the memory estimate (components/memory_estimate.h) need.
struct ModelSizes {
  int64_t vocab_size = 0, dim = 0, n_layers = 0, head_dim = 0;
  int64_t kv_dim = 0;  // n_kv_heads · head_dim
  int64_t ffn = 0;     // feed-forward width one token goes through (MoE: top_k · expert width)
  int64_t n_heads = 0, n_kv_heads = 0;
  int64_t ffn_hidden = 0;  // the FFN's hidden width as its weights hold it (MoE: one expert's)
  int64_t total_params = 0, embedding_params = 0;
  double flops_per_token = 0;
};

// A model built for inference in one process (checkpoint_tool logits, generate): float32,
// parameters allocated but not loaded, train mode (the caller sets eval).
struct InferenceNet {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;                   // tokens [B, T] -> logits
  std::function<torch::Tensor(const torch::Tensor&, KVCache&)> forward_cached;  // DecoderImpl::forward_cached
  std::function<KVCache(int64_t batch, int64_t capacity)> new_cache;            // float32
};

struct ParallelizeArgs;  // training/parallelize.h: the config, process groups, device; what was applied

struct ModelSpec {
  std::string name;                  // model.name
  std::vector<std::string> flavors;  // model.flavor's values, in the order errors list them
  bool moe = false;                  // TrainModel's MoE hooks are set

  // The flavor with max_seq_len = seq_len, validated. UserError for an unknown flavor
  // ("unknown model.flavor \"x\" for <name>; valid: …") or args that do not validate.
  std::function<ModelSizes(const std::string& flavor, int64_t seq_len)> sizes;
  // The flavor's own RoPE table length (generate's default context).
  std::function<int64_t(const std::string& flavor)> max_seq_len;
  // The training model (torchtitan's order: built, then initialised per `init`).
  std::function<TrainModel(const std::string& flavor, int64_t seq_len, ModelInit init)> build;
  // How the family is parallelised (torchtitan's parallelize_fn), applied by train.cpp to the
  // built model; empty: the default all families share today (training/parallelize.h: AC, then
  // FSDP). Models include no parallelisms/: a family's own hook is defined outside models/.
  std::function<void(TrainModel&, ParallelizeArgs&)> parallelize;
  // The flavor with this vocabulary and RoPE length; hf (may be null): the config.json the
  // weights come with, whose rms_norm_eps, rope_theta and rope_scaling win over the flavor's.
  std::function<InferenceNet(const std::string& flavor, int64_t vocab_size, int64_t max_seq_len,
                             const HFModelConfig* hf)>
      build_inference;

  // Hugging Face: config.json's "architectures"[0] and "model_type", the config of a flavor
  // (with the vocabulary the run's tokenizer gave it), and ctitan's parameters with their HF
  // names (decoder_params / decoder_hf_pieces for the shared decoder).
  std::string hf_architecture, hf_model_type;
  std::function<HFModelConfig(const std::string& flavor, int64_t vocab_size)> hf_config;
  std::function<ParamList(const HFModelConfig&)> hf_params;  // named_parameters() order
  // The HF tensors of one parameter; UserError when it has none.
  std::function<std::vector<HFPiece>(const std::string& fqn, const std::vector<int64_t>& shape, const HFModelConfig&)>
      hf_pieces;
};

// "unknown model.flavor \"<flavor>\" for <family>; valid: a, b, c" as a UserError.
[[noreturn]] void throw_unknown_flavor(const std::string& family, const std::string& flavor,
                                       const std::vector<std::string>& valid);

// The sizes every decoder shares, from its args (models/decoder_args.h), with the family's
// feed-forward width and its counts of parameters and FLOPs.
ModelSizes decoder_sizes(const DecoderArgs& a, int64_t ffn, int64_t total_params, int64_t embedding_params,
                         double flops_per_token);

// The TrainModel of a decoder (models/decoder.h) with these sizes, initialised per `init`
// (Full: init_weights(); Deferred / None: nothing drawn), in train mode. The family's step
// hooks stay empty.
class DecoderImpl;
TrainModel decoder_train_model(const std::shared_ptr<DecoderImpl>& model, ModelInit init, const ModelSizes& sizes);
// The InferenceNet of a decoder.
InferenceNet decoder_inference_net(const std::shared_ptr<DecoderImpl>& model);

}  // namespace ctitan
