// ctitan <-> Hugging Face names of the shared decoder; see hf_names.h.
#include <map>
#include <regex>

#include "config/errors.h"
#include "models/hf_names.h"

namespace ctitan {

ParamList decoder_params(const HFModelConfig& c, bool moe) {
  const int64_t D = c.hidden_size, hd = c.head_dim(), H = c.num_attention_heads, KV = c.num_key_value_heads;
  const int64_t F = c.intermediate_size, V = c.vocab_size, E = c.num_local_experts;
  ParamList p;
  p.push_back({"tok_embeddings.weight", {V, D}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    p.push_back({l + "attention.wq.weight", {H * hd, D}});
    p.push_back({l + "attention.wk.weight", {KV * hd, D}});
    p.push_back({l + "attention.wv.weight", {KV * hd, D}});
    p.push_back({l + "attention.wo.weight", {D, H * hd}});
    if (moe) {
      p.push_back({l + "moe.router.gate.weight", {E, D}});
      p.push_back({l + "moe.experts.w1", {E, F, D}});
      p.push_back({l + "moe.experts.w2", {E, D, F}});
      p.push_back({l + "moe.experts.w3", {E, F, D}});
    } else {
      p.push_back({l + "feed_forward.w1.weight", {F, D}});
      p.push_back({l + "feed_forward.w2.weight", {D, F}});
      p.push_back({l + "feed_forward.w3.weight", {F, D}});
    }
    p.push_back({l + "attention_norm.weight", {D}});
    p.push_back({l + "ffn_norm.weight", {D}});
  }
  p.push_back({"norm.weight", {D}});
  p.push_back({"output.weight", {V, D}});
  return p;
}

std::vector<HFPiece> decoder_hf_pieces(const std::string& fqn, const std::vector<int64_t>& shape,
                                       const HFModelConfig& c) {
  const int64_t rows = shape.empty() ? 1 : shape[0];
  auto whole = [&](const std::string& key, int64_t rope_heads = 0) {
    return std::vector<HFPiece>{{key, shape, 0, rows, rope_heads}};
  };
  if (fqn == "tok_embeddings.weight") return whole("model.embed_tokens.weight");
  if (fqn == "norm.weight") return whole("model.norm.weight");
  if (fqn == "output.weight") return whole("lm_head.weight");
  static const std::regex layer_re(R"(layers\.([0-9]+)\.(.+))");
  std::smatch m;
  if (std::regex_match(fqn, m, layer_re)) {
    const std::string l = "model.layers." + std::string(m[1]) + ".", rest = m[2];
    static const std::map<std::string, std::string> plain = {
        {"attention.wv.weight", "self_attn.v_proj.weight"},
        {"attention.wo.weight", "self_attn.o_proj.weight"},
        {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
        {"feed_forward.w3.weight", "mlp.up_proj.weight"},
        {"feed_forward.w2.weight", "mlp.down_proj.weight"},
        {"attention_norm.weight", "input_layernorm.weight"},
        {"ffn_norm.weight", "post_attention_layernorm.weight"},
        {"moe.router.gate.weight", "block_sparse_moe.gate.weight"}};
    if (rest == "attention.wq.weight") return whole(l + "self_attn.q_proj.weight", c.num_attention_heads);
    if (rest == "attention.wk.weight") return whole(l + "self_attn.k_proj.weight", c.num_key_value_heads);
    if (auto it = plain.find(rest); it != plain.end()) return whole(l + it->second);
    if (rest == "moe.experts.w1" || rest == "moe.experts.w2" || rest == "moe.experts.w3") {
      std::vector<HFPiece> out;
      const std::vector<int64_t> expert_shape(shape.begin() + 1, shape.end());
      for (int64_t j = 0; j < rows; ++j)
        out.push_back({l + "block_sparse_moe.experts." + std::to_string(j) + "." + rest.substr(12) + ".weight",
                       expert_shape, j, j + 1, 0});
      return out;
    }
  }
  throw UserError("HF interop: ctitan parameter " + fqn + " has no Hugging Face name");
}

HFRopeScaling to_hf(const RoPEScalingArgs& a) {
  return {a.scaling_factor, a.low_freq_factor, a.high_freq_factor, a.original_max_position_embeddings};
}

RoPEScalingArgs from_hf(const HFRopeScaling& s) {
  return {s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings};
}

HFModelConfig decoder_hf_config(const DecoderArgs& a, const std::string& architecture, int64_t intermediate_size,
                                int64_t vocab_size) {
  HFModelConfig c;
  c.architecture = architecture;
  c.hidden_size = a.dim;
  c.intermediate_size = intermediate_size;
  c.num_attention_heads = a.n_heads;
  c.num_key_value_heads = a.kv_heads();
  c.num_hidden_layers = a.n_layers;
  c.max_position_embeddings = a.max_seq_len;
  c.rms_norm_eps = a.norm_eps;
  c.rope_theta = a.rope_theta;
  if (a.rope_scaling) c.rope_scaling = to_hf(*a.rope_scaling);
  c.vocab_size = vocab_size;
  return c;
}

void apply_hf_overrides(DecoderArgs& a, const HFModelConfig* hf) {
  if (!hf) return;
  a.norm_eps = hf->rms_norm_eps;
  a.rope_theta = hf->rope_theta;
  a.rope_scaling = hf->rope_scaling ? std::optional(from_hf(*hf->rope_scaling)) : std::nullopt;
}

}  // namespace ctitan
