// Hugging Face interop: the model as a folder of safetensors files with HF's names, plus a
// config.json, written from and read into ctitan's parameters (torchtitan's state-dict
// adapter, done here in C++).
//
//   <folder>/model.safetensors               every tensor (HF names, export dtype)
//   <folder>/model.safetensors.index.json    {"metadata": {"total_size": n}, "weight_map": {...}}
//   <folder>/config.json                     the architecture's fields (HFModelConfig)
//   <folder>/COMPLETE                        (step folders of a run) written last, see format.h
// Reading accepts any folder of *.safetensors files with a config.json (the index is
// checked when present), so checkpoints from HF's hub load too.
//
// Names, config.json's family fields and the families' flavors come from the HFAdapter the
// caller hands in (hf_types/hf_adapter.h, filled by models/hf_adapter.h); the rotary row order
// of q_proj / k_proj is described in hf_types/hf_config.h.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>

#include "checkpoint/safetensors.h"
#include "hf_types/hf_adapter.h"

namespace ctitan {

class CheckpointReader;

// config.json's text for c, and c read back from a config.json's text (UserError
// "<where>: ..." when a needed field is missing or malformed, or no registered family loads
// the architecture). The fields of c's family beyond the shared decoder's come from `families`.
std::string hf_config_json(const HFModelConfig& c, const HFAdapter& families);
HFModelConfig parse_hf_config(const std::string& text, const std::string& where, const HFAdapter& families);

// The flavor of `model_name` ("" = the family that loads c's architecture) whose structure
// (structure_difference, hf_types/hf_config.h) the config describes, or "" when none does.
std::string find_flavor(const HFModelConfig& c, const HFAdapter& families, const std::string& model_name = "");

// w [H·hd, D] in ctitan's rotary order -> HF's, and back (torchtitan's _permute /
// _reverse_permute). New tensors.
at::Tensor rope_rows_to_hf(const at::Tensor& w, int64_t heads);
at::Tensor rope_rows_from_hf(const at::Tensor& w, int64_t heads);

// Writes model.safetensors, model.safetensors.index.json and config.json (durably) into
// the existing folder `dir`. params must be exactly families.params(c) (UserError naming the
// first difference otherwise); read_full(fqn) returns a parameter's full tensor. Tensors
// are written in `dtype` (float32 | bfloat16 | float16); metadata goes to __metadata__
// next to "format": "pt". Returns the index file's text (for the COMPLETE marker).
std::string write_hf_files(const std::string& dir, HFModelConfig c, const ParamList& params, const std::string& dtype,
                           const std::function<at::Tensor(const std::string&)>& read_full,
                           const std::map<std::string, std::string>& metadata, const HFAdapter& families);

// The model of a ctitan checkpoint (any saved sharding) as HF files in the existing folder
// `dir`, in `dtype` ("" = as saved). __metadata__ records "ctitan.model" = "<name> <flavor>"
// and "ctitan.step". Returns the index text.
std::string write_hf_from_checkpoint(const CheckpointReader& r, const std::string& dir, const std::string& dtype,
                                     const HFAdapter& families);

// True when `path` is a folder holding a *.safetensors file.
bool is_hf_folder(const std::string& path);

// A folder of safetensors files and a config.json, opened for reading (headers validated,
// the index checked against the files when present).
class HFCheckpoint {
 public:
  // UserError when the folder or config.json is missing or holds no *.safetensors; a
  // RuntimeFailure naming the file for any malformed safetensors file or index.
  HFCheckpoint(std::string dir, HFAdapter families);
  const std::string& path() const { return dir_; }
  const HFModelConfig& config() const { return config_; }
  // __metadata__ of the first file (ctitan writes "ctitan.model" = "<name> <flavor>",
  // "ctitan.step").
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> keys() const;                              // sorted
  const safetensors::TensorInfo& info(const std::string& key) const;  // RuntimeFailure when absent
  std::string file_of(const std::string& key) const;
  at::Tensor read(const std::string& key) const;  // the whole tensor, file dtype

  // ctitan's view. UserError unless every HF tensor of `fqn` exists with the right shape and
  // a floating dtype.
  void check_param(const std::string& fqn, const std::vector<int64_t>& shape) const;
  // Global rows [begin, end) of parameter fqn (shape = its global shape) into
  // dest[0 : end-begin], converted to dest's dtype; rows of dest past that zeroed (FSDP
  // padding). Only the rows needed are read, except for q/k projections (whole tensor).
  void read_param_rows(const std::string& fqn, const std::vector<int64_t>& shape, int64_t begin, int64_t end,
                       const at::Tensor& dest) const;
  at::Tensor read_param(const std::string& fqn, const std::vector<int64_t>& shape) const;  // file dtype
  // HF keys no ctitan parameter in `params` uses (e.g. rotary_emb.inv_freq).
  std::vector<std::string> unused_keys(const ParamList& params) const;

 private:
  std::string resolve(const std::string& key) const;  // lm_head.weight -> embed_tokens when tied
  std::string dir_;
  HFAdapter families_;
  HFModelConfig config_;
  std::vector<safetensors::Header> files_;
  std::map<std::string, std::pair<size_t, size_t>> where_;  // key -> (file, tensor index)
  std::map<std::string, std::string> metadata_;
};

}  // namespace ctitan
