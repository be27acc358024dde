// HF safetensors export / import; see hf.h.
#include "checkpoint/hf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>

#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/format.h"
#include "config/errors.h"
#include "util/json.h"
#include "util/strings.h"

namespace fs = std::filesystem;

namespace ctitan {
namespace {

at::ScalarType scalar_type_of(const std::string& st_dtype, const std::string& where) {
  if (st_dtype == "F32") return at::kFloat;
  if (st_dtype == "BF16") return at::kBFloat16;
  if (st_dtype == "F16") return at::kHalf;
  if (st_dtype == "F64") return at::kDouble;
  throw UserError(where + " has dtype " + st_dtype + ", not a floating type ctitan loads (F32, BF16, F16, F64)");
}

std::string st_dtype_of(const std::string& dtype) {
  if (dtype == "float32") return "F32";
  if (dtype == "bfloat16") return "BF16";
  if (dtype == "float16") return "F16";
  throw UserError("HF export dtype \"" + dtype + "\" is not one of: float32, bfloat16, float16");
}

at::ScalarType torch_dtype_of(const std::string& dtype) {
  if (dtype == "float32") return at::kFloat;
  if (dtype == "bfloat16") return at::kBFloat16;
  return at::kHalf;
}

int64_t row_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

}  // namespace

// ---- config.json -------------------------------------------------------------------------------

std::string hf_config_json(const HFModelConfig& c, const HFAdapter& families) {
  std::string s = "{\n";
  auto field = [&](const std::string& k, const std::string& v) { s += "  \"" + k + "\": " + v + ",\n"; };
  field("architectures", "[\"" + c.architecture + "\"]");
  field("model_type", "\"" + families.model_type_of(c.architecture) + "\"");
  field("hidden_size", std::to_string(c.hidden_size));
  field("intermediate_size", std::to_string(c.intermediate_size));
  field("num_attention_heads", std::to_string(c.num_attention_heads));
  field("num_key_value_heads", std::to_string(c.num_key_value_heads));
  field("head_dim", std::to_string(c.head_dim()));
  field("num_hidden_layers", std::to_string(c.num_hidden_layers));
  field("vocab_size", std::to_string(c.vocab_size));
  field("max_position_embeddings", std::to_string(c.max_position_embeddings));
  field("rms_norm_eps", hf_json_number(c.rms_norm_eps));
  field("rope_theta", hf_json_number(c.rope_theta));
  if (c.rope_scaling)
    field("rope_scaling", "{\"rope_type\": \"" + std::string(kHfRopeScalingType) +
                              "\", \"factor\": " + hf_json_number(c.rope_scaling->factor) +
                              ", \"low_freq_factor\": " + hf_json_number(c.rope_scaling->low_freq_factor) +
                              ", \"high_freq_factor\": " + hf_json_number(c.rope_scaling->high_freq_factor) +
                              ", \"original_max_position_embeddings\": " +
                              std::to_string(c.rope_scaling->original_max_position_embeddings) + "}");
  else
    field("rope_scaling", "null");
  for (const auto& [key, value] : families.family_json(c)) field(key, value);
  field("hidden_act", "\"silu\"");
  field("attention_dropout", "0.0");
  field("initializer_range", "0.02");
  field("use_cache", "true");
  field("tie_word_embeddings", c.tie_word_embeddings ? "true" : "false");
  s += "  \"torch_dtype\": \"" + c.torch_dtype + "\"\n}\n";
  return s;
}

namespace {

// Fields of a config.json object; errors name the file (`where`).
struct JsonFields {
  const std::string& where;
  int64_t integer(const json::Value& obj, const char* k, bool required, int64_t dflt) const {
    const json::Value* v = obj.find(k);
    int64_t x = 0;
    if (!v || v->type == json::Value::Type::Null) {
      if (required) throw UserError(where + " has no \"" + std::string(k) + "\"");
      return dflt;
    }
    if (!v->as_int64(&x) || x < 0)
      throw UserError(where + ": \"" + std::string(k) + "\" is not a non-negative integer");
    return x;
  }
  double real(const json::Value& obj, const char* k, double dflt) const {
    const json::Value* v = obj.find(k);
    if (!v || v->type == json::Value::Type::Null) return dflt;
    if (v->type != json::Value::Type::Number) throw UserError(where + ": \"" + std::string(k) + "\" is not a number");
    return std::strtod(v->text.c_str(), nullptr);
  }
};

// "architectures"[0], else the architecture of "model_type"; UserError unless a registered
// family loads it.
std::string parse_architecture(const json::Value& root, const std::string& where, const HFAdapter& families) {
  auto get = [](const json::Value& obj, const char* k) -> const json::Value* { return obj.find(k); };
  std::string architecture;
  const json::Value* arch = get(root, "architectures");
  if (arch && arch->type == json::Value::Type::Array && !arch->items.empty() &&
      arch->items[0].type == json::Value::Type::String)
    architecture = arch->items[0].text;
  if (architecture.empty()) {
    const json::Value* mt = get(root, "model_type");
    const std::string t = mt && mt->type == json::Value::Type::String ? mt->text : "";
    architecture = t.empty() ? "" : families.architecture_of_type(t);
  }
  if (families.family_of(architecture).empty()) {
    std::string known;
    for (const auto& a : families.architectures) known += (known.empty() ? "" : ", ") + a;
    throw UserError(where + ": architecture \"" + architecture + "\" is not one ctitan loads (" + known + ")");
  }
  return architecture;
}

// rope_theta and rope_scaling (either spelling) into c.
void parse_rope(const json::Value& root, const JsonFields& f, HFModelConfig& c) {
  auto get = [](const json::Value& obj, const char* k) -> const json::Value* { return obj.find(k); };
  const std::string& where = f.where;
  auto integer = [&f](const json::Value& obj, const char* k, bool required, int64_t dflt) {
    return f.integer(obj, k, required, dflt);
  };
  auto real = [&f](const json::Value& obj, const char* k, double dflt) { return f.real(obj, k, dflt); };
  c.rope_theta = real(root, "rope_theta", 10000);
  // transformers 5 writes RoPE as one object, "rope_parameters": {"rope_theta", "rope_type"
  // ("default" or kHfRopeScalingType with its factors)}, instead of rope_theta + rope_scaling.
  const json::Value* rs = get(root, "rope_scaling");
  if (const json::Value* rp = get(root, "rope_parameters"); rp && rp->type == json::Value::Type::Object) {
    c.rope_theta = real(*rp, "rope_theta", c.rope_theta);
    const json::Value* type = rp->find("rope_type");
    if (type && type->type == json::Value::Type::String && type->text == "default")
      rs = nullptr;
    else
      rs = rp;
  }
  if (rs && rs->type == json::Value::Type::Object) {
    const json::Value* type = rs->find("rope_type");
    if (!type) type = rs->find("type");
    if (!type || type->type != json::Value::Type::String || type->text != kHfRopeScalingType)
      throw UserError(where + ": rope_scaling of type \"" + (type ? type->text : std::string("?")) +
                      "\" is not supported (ctitan implements \"" + kHfRopeScalingType + "\")");
    HFRopeScaling s;
    s.factor = real(*rs, "factor", s.factor);
    s.low_freq_factor = real(*rs, "low_freq_factor", s.low_freq_factor);
    s.high_freq_factor = real(*rs, "high_freq_factor", s.high_freq_factor);
    s.original_max_position_embeddings =
        integer(*rs, "original_max_position_embeddings", false, s.original_max_position_embeddings);
    c.rope_scaling = s;
  }
}

}  // namespace

HFModelConfig parse_hf_config(const std::string& text, const std::string& where, const HFAdapter& families) {
  json::Value root;
  std::string err;
  if (!json::parse(text, &root, &err) || root.type != json::Value::Type::Object)
    throw UserError(where + " is not a JSON object" + (err.empty() ? "" : ": " + err));
  auto get = [](const json::Value& obj, const char* k) -> const json::Value* { return obj.find(k); };
  const JsonFields f{where};
  auto integer = [&f](const json::Value& obj, const char* k, bool required, int64_t dflt) {
    return f.integer(obj, k, required, dflt);
  };
  auto real = [&f](const json::Value& obj, const char* k, double dflt) { return f.real(obj, k, dflt); };
  HFModelConfig c;
  c.architecture = parse_architecture(root, where, families);
  c.hidden_size = integer(root, "hidden_size", true, 0);
  c.intermediate_size = integer(root, "intermediate_size", true, 0);
  c.num_attention_heads = integer(root, "num_attention_heads", true, 0);
  c.num_key_value_heads = integer(root, "num_key_value_heads", false, c.num_attention_heads);
  c.num_hidden_layers = integer(root, "num_hidden_layers", true, 0);
  c.vocab_size = integer(root, "vocab_size", true, 0);
  c.max_position_embeddings = integer(root, "max_position_embeddings", false, 0);
  if (c.num_attention_heads == 0 || c.hidden_size % c.num_attention_heads != 0)
    throw UserError(where + ": hidden_size " + std::to_string(c.hidden_size) +
                    " is not a multiple of num_attention_heads " + std::to_string(c.num_attention_heads));
  if (const json::Value* hd = get(root, "head_dim"); hd && hd->type != json::Value::Type::Null) {
    int64_t x = 0;
    if (!hd->as_int64(&x) || x != c.head_dim())
      throw UserError(where + ": head_dim " + hd->text + " is not hidden_size / num_attention_heads = " +
                      std::to_string(c.head_dim()) + " (ctitan's attention requires it)");
  }
  c.rms_norm_eps = real(root, "rms_norm_eps", 1e-6);
  parse_rope(root, f, c);
  families.read_family_json(
      c, HFFieldReader{[&](const char* k, bool required, int64_t dflt) { return integer(root, k, required, dflt); },
                       [&](const char* k, double dflt) { return real(root, k, dflt); }});
  if (const json::Value* t = get(root, "tie_word_embeddings"); t && t->type == json::Value::Type::Bool)
    c.tie_word_embeddings = t->boolean;
  if (const json::Value* t = get(root, "torch_dtype"); t && t->type == json::Value::Type::String)
    c.torch_dtype = t->text;
  return c;
}

std::string find_flavor(const HFModelConfig& c, const HFAdapter& families, const std::string& model_name) {
  const std::string family = model_name.empty() ? families.family_of(c.architecture) : model_name;
  if (family.empty() ||
      std::find(families.families.begin(), families.families.end(), family) == families.families.end())
    return "";
  for (const auto& f : families.flavors(family))
    if (structure_difference(families.config_for(family, f, c.vocab_size), c).empty()) return f;
  return "";
}

at::Tensor rope_rows_to_hf(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  TORCH_CHECK(rows % (2 * heads) == 0, "[hf] ", rows, " rows do not split into ", heads, " heads of even size");
  return w.view({heads, rows / heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols}).clone();
}

at::Tensor rope_rows_from_hf(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  TORCH_CHECK(rows % (2 * heads) == 0, "[hf] ", rows, " rows do not split into ", heads, " heads of even size");
  return w.view({heads, 2, rows / heads / 2, cols}).transpose(1, 2).reshape({rows, cols}).clone();
}

// ---- export -------------------------------------------------------------------------------------

std::string write_hf_files(const std::string& dir, HFModelConfig c, const ParamList& params, const std::string& dtype,
                           const std::function<at::Tensor(const std::string&)>& read_full,
                           const std::map<std::string, std::string>& metadata, const HFAdapter& families) {
  const std::string st_dtype = st_dtype_of(dtype);
  const ParamList want = families.params(c);
  std::map<std::string, std::vector<int64_t>> have(params.begin(), params.end());
  for (const auto& [fqn, shape] : want) {
    auto it = have.find(fqn);
    if (it == have.end())
      throw UserError("HF export: the model has no parameter " + fqn + " (" + c.architecture + " needs it)");
    if (it->second != shape)
      throw UserError("HF export: " + fqn + " has shape " + shape_str(it->second) + ", config.json describes " +
                      shape_str(shape));
    have.erase(it);
  }
  if (!have.empty())
    throw UserError("HF export: parameter " + have.begin()->first + " has no place in " + c.architecture);

  std::vector<safetensors::TensorSpec> specs;
  uint64_t total = 0;
  for (const auto& [fqn, shape] : want)
    for (const auto& piece : families.pieces(fqn, shape, c)) {
      specs.push_back({piece.key, st_dtype, piece.shape});
      uint64_t n = safetensors::dtype_size(st_dtype);
      for (int64_t d : piece.shape) n *= static_cast<uint64_t>(d);
      total += n;
    }
  std::map<std::string, std::string> meta = metadata;
  meta["format"] = "pt";
  const std::string file = "model.safetensors";
  safetensors::Writer w((fs::path(dir) / file).string(), specs, meta);
  torch::NoGradGuard no_grad;
  for (const auto& [fqn, shape] : want) {
    // On the host whatever device the state lives on: the writer reads the bytes.
    at::Tensor t = read_full(fqn).to(at::kCPU, torch_dtype_of(dtype)).contiguous();
    TORCH_CHECK(t.sizes().vec() == shape, "[hf] read ", fqn, " with shape ", t.sizes(), ", expected ",
                shape_str(shape));
    for (const auto& piece : families.pieces(fqn, shape, c)) {
      at::Tensor part = piece.rope_heads ? rope_rows_to_hf(t, piece.rope_heads)
                                         : t.narrow(0, piece.row_begin, piece.row_end - piece.row_begin).contiguous();
      w.write(piece.key, part.data_ptr(), static_cast<size_t>(part.numel()) * part.element_size());
    }
  }
  w.commit();

  std::vector<std::string> keys;
  for (const auto& s : specs) keys.push_back(s.name);
  std::sort(keys.begin(), keys.end());
  std::string index = "{\n  \"metadata\": {\"total_size\": " + std::to_string(total) + "},\n  \"weight_map\": {\n";
  for (size_t i = 0; i < keys.size(); ++i)
    index += "    " + json::quote(keys[i]) + ": \"" + file + "\"" + (i + 1 < keys.size() ? "," : "") + "\n";
  index += "  }\n}\n";
  ckpt::write_file_durable((fs::path(dir) / "model.safetensors.index.json").string(), index);
  c.torch_dtype = dtype;
  ckpt::write_file_durable((fs::path(dir) / "config.json").string(), hf_config_json(c, families));
  return index;
}

std::string write_hf_from_checkpoint(const CheckpointReader& r, const std::string& dir, const std::string& dtype,
                                     const HFAdapter& families) {
  const auto& m = r.meta();
  if (!r.has("tok_embeddings.weight"))
    throw UserError("checkpoint " + r.path() + " has no tok_embeddings.weight: not a model ctitan exports to HF");
  const HFModelConfig c =
      families.config_for(m.model_name, m.model_flavor, r.entry("tok_embeddings.weight").shape.at(0));
  ParamList params;
  for (const auto& [key, e] : m.entries)
    if (!e.is_bytes && is_model_key(key)) params.push_back({key, e.shape});
  const std::string d = dtype.empty() ? r.entry("tok_embeddings.weight").dtype : dtype;
  return write_hf_files(
      dir, c, params, d, [&r](const std::string& fqn) { return r.read_tensor(fqn); },
      {{"ctitan.model", m.model_name + " " + m.model_flavor}, {"ctitan.step", std::to_string(m.step)}}, families);
}

// ---- import -------------------------------------------------------------------------------------

bool is_hf_folder(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  for (const auto& de : fs::directory_iterator(path, ec))
    if (de.path().extension() == ".safetensors") return true;
  return false;
}

HFCheckpoint::HFCheckpoint(std::string dir, HFAdapter families) : dir_(std::move(dir)), families_(std::move(families)) {
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) throw UserError("HF checkpoint " + dir_ + " is not a folder");
  const fs::path cfg = fs::path(dir_) / "config.json";
  if (!fs::exists(cfg, ec)) throw UserError("HF checkpoint " + dir_ + " has no config.json");
  config_ = parse_hf_config(ckpt::read_whole_file(cfg.string()), cfg.string(), families_);
  std::vector<std::string> names;
  for (const auto& de : fs::directory_iterator(dir_, ec))
    if (de.path().extension() == ".safetensors") names.push_back(de.path().filename().string());
  std::sort(names.begin(), names.end());
  if (names.empty()) throw UserError("HF checkpoint " + dir_ + " holds no *.safetensors file");
  for (const auto& n : names) {
    files_.push_back(safetensors::read_header((fs::path(dir_) / n).string()));
    const auto& h = files_.back();
    for (size_t t = 0; t < h.tensors.size(); ++t) {
      auto [it, fresh] = where_.emplace(h.tensors[t].name, std::make_pair(files_.size() - 1, t));
      if (!fresh)
        throw RuntimeFailure("HF checkpoint " + dir_ + ": tensor " + h.tensors[t].name + " is in both " +
                             fs::path(files_[it->second.first].file).filename().string() + " and " + n);
    }
  }
  metadata_ = files_.front().metadata;
  const fs::path index = fs::path(dir_) / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    json::Value root;
    std::string err;
    const std::string where = "HF checkpoint index " + index.string();
    if (!json::parse(ckpt::read_whole_file(index.string()), &root, &err) || root.type != json::Value::Type::Object)
      throw RuntimeFailure(where + " is not a JSON object" + (err.empty() ? "" : ": " + err));
    const json::Value* map = root.find("weight_map");
    if (!map || map->type != json::Value::Type::Object) throw RuntimeFailure(where + " has no weight_map object");
    std::set<std::string> listed;
    for (const auto& [key, file] : map->members) {
      auto it = where_.find(key);
      if (file.type != json::Value::Type::String || it == where_.end() ||
          fs::path(files_[it->second.first].file).filename().string() != file.text)
        throw RuntimeFailure(where + " maps " + key + " to " +
                             (file.type == json::Value::Type::String ? file.text : "?") + ", which does not hold it");
      listed.insert(key);
    }
    for (const auto& [key, loc] : where_)
      if (!listed.count(key)) throw RuntimeFailure(where + " does not list tensor " + key);
  }
}

std::vector<std::string> HFCheckpoint::keys() const {
  std::vector<std::string> k;
  for (const auto& kv : where_) k.push_back(kv.first);
  return k;
}

std::string HFCheckpoint::resolve(const std::string& key) const {
  // Tied embeddings (small hub models): no lm_head.weight, the output reuses embed_tokens.
  if (key == "lm_head.weight" && !where_.count(key) && config_.tie_word_embeddings) return "model.embed_tokens.weight";
  return key;
}

const safetensors::TensorInfo& HFCheckpoint::info(const std::string& key) const {
  auto it = where_.find(resolve(key));
  if (it == where_.end()) throw RuntimeFailure("HF checkpoint " + dir_ + " has no tensor " + key);
  return files_[it->second.first].tensors[it->second.second];
}

std::string HFCheckpoint::file_of(const std::string& key) const {
  auto it = where_.find(resolve(key));
  if (it == where_.end()) throw RuntimeFailure("HF checkpoint " + dir_ + " has no tensor " + key);
  return files_[it->second.first].file;
}

at::Tensor HFCheckpoint::read(const std::string& key) const {
  const auto& t = info(key);
  const auto& h = files_[where_.at(resolve(key)).first];
  auto out = torch::empty(t.shape, torch::TensorOptions().dtype(scalar_type_of(t.dtype, h.file + " tensor " + key)));
  safetensors::read_bytes(h, t, 0, t.end - t.begin, out.data_ptr());
  return out;
}

void HFCheckpoint::check_param(const std::string& fqn, const std::vector<int64_t>& shape) const {
  for (const auto& piece : families_.pieces(fqn, shape, config_)) {
    auto it = where_.find(resolve(piece.key));
    if (it == where_.end())
      throw UserError("HF checkpoint " + dir_ + " has no tensor " + piece.key + " (ctitan's " + fqn + ")");
    const auto& t = files_[it->second.first].tensors[it->second.second];
    if (t.shape != piece.shape)
      throw UserError("HF checkpoint " + dir_ + ": " + piece.key + " has shape " + shape_str(t.shape) +
                      ", this run's " + fqn + " needs " + shape_str(piece.shape));
    scalar_type_of(t.dtype, "HF checkpoint " + dir_ + ": " + piece.key);
  }
}

void HFCheckpoint::read_param_rows(const std::string& fqn, const std::vector<int64_t>& shape, int64_t begin,
                                   int64_t end, const at::Tensor& dest) const {
  torch::NoGradGuard no_grad;
  const int64_t rows = shape.empty() ? 1 : shape[0], rn = row_numel(shape);
  TORCH_CHECK(0 <= begin && begin <= end && end <= rows, "[hf] rows [", begin, ", ", end, ") of ", fqn, " outside [0, ",
              rows, ")");
  TORCH_CHECK(dest.is_contiguous(), "[hf] destination of ", fqn, " must be contiguous");
  at::Tensor d2 = dest.dim() == 0 ? dest.view({1, 1}) : dest.view({dest.size(0), -1});
  TORCH_CHECK(d2.size(0) >= end - begin && d2.size(1) == rn, "[hf] destination of ", fqn, " has the wrong shape");
  for (const auto& piece : families_.pieces(fqn, shape, config_)) {
    const int64_t s = std::max(begin, piece.row_begin), t = std::min(end, piece.row_end);
    if (s >= t) continue;
    const auto& info_ = info(piece.key);
    const auto& h = files_[where_.at(resolve(piece.key)).first];
    const at::ScalarType st = scalar_type_of(info_.dtype, h.file + " tensor " + piece.key);
    at::Tensor src;
    if (piece.rope_heads) {
      // Rows of one head come from all over the HF tensor: read it whole and reorder.
      src = rope_rows_from_hf(read(piece.key), piece.rope_heads).view({rows, rn}).narrow(0, s, t - s);
    } else {
      const uint64_t row_bytes = static_cast<uint64_t>(rn) * safetensors::dtype_size(info_.dtype);
      src = torch::empty({t - s, rn}, torch::TensorOptions().dtype(st));
      safetensors::read_bytes(h, info_, (s - piece.row_begin) * row_bytes, (t - piece.row_begin) * row_bytes,
                              src.data_ptr());
    }
    d2.narrow(0, s - begin, t - s).copy_(src);
  }
  if (d2.size(0) > end - begin) d2.narrow(0, end - begin, d2.size(0) - (end - begin)).zero_();
}

at::Tensor HFCheckpoint::read_param(const std::string& fqn, const std::vector<int64_t>& shape) const {
  const auto pieces = families_.pieces(fqn, shape, config_);
  const auto& first = info(pieces.at(0).key);
  auto out =
      torch::empty(shape, torch::TensorOptions().dtype(scalar_type_of(first.dtype, dir_ + " tensor " + first.name)));
  read_param_rows(fqn, shape, 0, shape.empty() ? 1 : shape[0], out);
  return out;
}

std::vector<std::string> HFCheckpoint::unused_keys(const ParamList& params) const {
  std::set<std::string> used;
  for (const auto& [fqn, shape] : params)
    for (const auto& p : families_.pieces(fqn, shape, config_)) used.insert(resolve(p.key));
  std::vector<std::string> out;
  for (const auto& kv : where_)
    if (!used.count(kv.first)) out.push_back(kv.first);
  return out;
}

}  // namespace ctitan
