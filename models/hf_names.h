// ctitan <-> Hugging Face names of the shared decoder (models/decoder.h), which each family's
// ModelSpec uses for its HF adapter; the format's types are hf_types/hf_config.h's.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "hf_types/hf_config.h"
#include "models/decoder_args.h"
#include "models/rope_args.h"

namespace ctitan {

// The shared decoder's parameters and their HF names, for a dense SwiGLU feed-forward
// ("feed_forward", HF "mlp") or a mixture of experts ("moe", HF "block_sparse_moe").
ParamList decoder_params(const HFModelConfig& c, bool moe);
// Either feed-forward's names are recognised. UserError when `fqn` has no HF name.
std::vector<HFPiece> decoder_hf_pieces(const std::string& fqn, const std::vector<int64_t>& shape,
                                       const HFModelConfig& c);

// RoPE scaling between the model's arguments and config.json's.
HFRopeScaling to_hf(const RoPEScalingArgs& a);
RoPEScalingArgs from_hf(const HFRopeScaling& s);

// config.json of a decoder: the shared fields from `a` (sizes, norm, RoPE), with this
// architecture, feed-forward width and vocabulary; the family adds its own (e.g. experts).
HFModelConfig decoder_hf_config(const DecoderArgs& a, const std::string& architecture, int64_t intermediate_size,
                                int64_t vocab_size);
// What a config.json says beyond the structure (hf may be null: nothing): its rms_norm_eps,
// rope_theta and rope_scaling replace a's.
void apply_hf_overrides(DecoderArgs& a, const HFModelConfig* hf);

}  // namespace ctitan
