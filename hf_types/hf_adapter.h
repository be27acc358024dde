// What checkpoint/ asks of the model families when it reads, writes, converts or inspects
// Hugging Face folders and the tensors of checkpoints that record no family: torchtitan's
// state-dict adapter, for every registered family at once (an HF folder names an architecture,
// not a family). models/ fills it (models/hf_adapter.h: hf_adapter()); the caller hands it in
// (train through training/checkpointing, checkpoint_tool, generate, tests), so checkpoint/
// never includes models/ and models/ never includes checkpoint/.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "hf_types/hf_config.h"

namespace ctitan {

// config.json's top-level fields as a family reads its own: UserError naming the file when a
// required one is missing or malformed.
struct HFFieldReader {
  std::function<int64_t(const char* key, bool required, int64_t dflt)> integer;
  std::function<double(const char* key, double dflt)> real;
};

struct HFAdapter {
  // ---- families and their flavors
  std::vector<std::string> families;  // registration order (model.name's choices)
  // UserError for an unknown family.
  std::function<std::vector<std::string>(const std::string& family)> flavors;
  // The config of `family`'s flavor with the vocabulary the run's tokenizer gave it. UserError
  // for an unknown family or flavor.
  std::function<HFModelConfig(const std::string& family, const std::string& flavor, int64_t vocab_size)> config_for;

  // ---- architectures ("" answers: none registered)
  std::vector<std::string> architectures;  // each once, registration order
  // The architecture of a family; UserError for an unknown family.
  std::function<std::string(const std::string& family)> architecture_of;
  // The family that loads an architecture when none is named (the first registered with it).
  std::function<std::string(const std::string& architecture)> family_of;
  // config.json's "model_type" of an architecture, and the architecture of a model_type.
  std::function<std::string(const std::string& architecture)> model_type_of;
  std::function<std::string(const std::string& model_type)> architecture_of_type;

  // ---- config.json: the fields of c's family beyond the shared decoder's, as "key" and JSON
  // text in file order; and read back into c (c.architecture set).
  std::function<std::vector<std::pair<std::string, std::string>>(const HFModelConfig& c)> family_json;
  std::function<void(HFModelConfig& c, const HFFieldReader& fields)> read_family_json;
  // What inspect adds to the structure line for c's family ("" or ", <field> ...").
  std::function<std::string(const HFModelConfig& c)> describe;

  // ---- names: ctitan's parameters of the model c describes (named_parameters() order), and
  // the HF tensors of one of them (UserError when it has none). UserError when no family
  // loads c's architecture.
  std::function<ParamList(const HFModelConfig& c)> params;
  std::function<std::vector<HFPiece>(const std::string& fqn, const std::vector<int64_t>& shape, const HFModelConfig& c)>
      pieces;

  // ---- tensors that record no family (a DCP folder, a .pt): the first registered family
  // whose blocks these parameter names belong to; UserError when none.
  std::function<std::string(const std::vector<std::string>& fqns)> family_of_params;
};

}  // namespace ctitan
