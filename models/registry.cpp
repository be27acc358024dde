// The model families ctitan knows, one line each; see registry.h. (A list rather than
// static self-registration: the linker drops unreferenced objects of a static library.)
#include "models/registry.h"

#include <algorithm>

#include "config/errors.h"
#include "models/llama/spec.h"
#include "models/llama2/spec.h"
#include "models/mixtral/spec.h"
#include "util/strings.h"

namespace ctitan {
namespace {

const std::vector<ModelSpec>& registry() {
  static const std::vector<ModelSpec> specs = {
      llama::llama3_spec(),
      mixtral::mixtral_spec(),
      llama2::llama2_spec(),
  };
  return specs;
}

}  // namespace

const ModelSpec* find_model_spec(const std::string& name) {
  for (const auto& s : registry())
    if (s.name == name) return &s;
  return nullptr;
}

const ModelSpec& model_spec(const std::string& name) {
  if (const ModelSpec* s = find_model_spec(name)) return *s;
  throw UserError("model.name = \"" + name + "\" is not one of: " + join(model_names(), ", "));
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& s : registry()) names.push_back(s.name);
  return names;
}

const ModelSpec* find_model_spec_for_hf(const std::string& architecture) {
  for (const auto& s : registry())
    if (s.hf_architecture == architecture) return &s;
  return nullptr;
}

std::string hf_architecture_of_model_type(const std::string& model_type) {
  for (const auto& s : registry())
    if (s.hf_model_type == model_type) return s.hf_architecture;
  return "";
}

std::vector<std::string> hf_architectures() {
  std::vector<std::string> out;
  for (const auto& s : registry())
    if (std::find(out.begin(), out.end(), s.hf_architecture) == out.end()) out.push_back(s.hf_architecture);
  return out;
}

[[noreturn]] void throw_unknown_flavor(const std::string& family, const std::string& flavor,
                                       const std::vector<std::string>& valid) {
  throw UserError("unknown model.flavor \"" + flavor + "\" for " + family + "; valid: " + join(valid, ", "));
}

}  // namespace ctitan
