// Inspect / verify / convert, and open_model; see convert.h and model_source.h.
#include "checkpoint/convert.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>

#include <torch/serialize.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/dcp.h"
#include "checkpoint/hf.h"
#include "checkpoint/model_source.h"
#include "checkpoint/torch_save.h"
#include "config/cli.h"
#include "config/errors.h"
#include "util/strings.h"

namespace fs = std::filesystem;

namespace ctitan {
namespace {

at::ScalarType export_dtype(const std::string& d) {
  if (d == "float32") return at::kFloat;
  if (d == "bfloat16") return at::kBFloat16;
  if (d == "float16") return at::kHalf;
  throw UserError("export dtype \"" + d + "\" is not one of: float32, bfloat16, float16");
}

}  // namespace

// (tests/test_checkpoint_hf.cpp runs scripts/pt_load_check.py in the venv.)
const char* const kPtLoadNote =
    "torch.save's format: torch.load reads it with its default weights_only=True, mmap=True too "
    "(checked with PyTorch 2.13.0+cpu)";

std::string inspect_checkpoint(const std::string& path, bool verify) {
  std::ostringstream out;
  std::error_code ec;
  if (!fs::exists(fs::path(path) / "metadata", ec) && !fs::exists(fs::path(path) / "COMPLETE", ec) &&
      !dcp::is_dcp_folder(path)) {
    const auto scan = ckpt::scan_folder(path);
    if (scan.complete.empty() && scan.incomplete.empty() && scan.staging.empty())
      throw UserError("checkpoint tool: " + path + " is neither a checkpoint nor a folder of step-<N> checkpoints");
    out << path << ":\n";
    for (int64_t s : scan.complete)
      out << "  step-" << s << "  complete"
          << (ckpt::is_hf_step(ckpt::step_dir(path, s)) ? " (HF safetensors, model only)" : "") << "\n";
    for (const auto& [dir, why] : scan.incomplete)
      out << "  " << fs::path(dir).filename().string() << "  INCOMPLETE: " << why << "\n";
    for (const auto& dir : scan.staging)
      out << "  " << fs::path(dir).filename().string() << "  save in progress or failed\n";
    return out.str();
  }
  CheckpointReader r(path);  // throws when incomplete or structurally damaged
  const auto& m = r.meta();
  out << "checkpoint " << path << "\n"
      << (r.is_dcp() ? std::string("  torch.distributed.checkpoint folder written by ") +
                           (r.is_foreign_dcp() ? "PyTorch (torchtitan?)" : "ctitan") + ", complete\n"
                     : "  format version " + std::to_string(m.version) + ", complete\n")
      << "  step " << m.step << (m.model_only ? " (model weights only)" : "") << "\n"
      << "  saved by " << m.world_size << " ranks, dp " << m.dp_replicate << " x " << m.dp_shard << "\n"
      << "  model " << (m.model_name.empty() ? std::string("(not recorded)") : m.model_name + " " + m.model_flavor)
      << "\n";
  uint64_t total = 0;
  for (const auto& f : m.files) {
    out << "  file " << f.name << "  " << f.size << " bytes";
    out << (r.is_dcp() ? std::string("\n") : "  crc32 " + ckpt::hex32(f.crc) + "\n");  // DCP: CRCs per item record
    total += f.size;
  }
  out << "  " << m.entries.size() << " entries, " << total << " bytes\n";
  size_t chunks = 0;
  for (const auto& [key, e] : m.entries) {
    out << "  " << key << "  " << ckpt::rule_name(e.rule) << "  ";
    if (e.is_bytes) {
      out << "bytes " << e.chunks[0].nbytes;
    } else {
      out << e.dtype << " [";
      for (size_t i = 0; i < e.shape.size(); ++i) out << (i ? ", " : "") << e.shape[i];
      out << "]";
    }
    out << "  " << e.chunks.size() << (e.chunks.size() == 1 ? " chunk" : " chunks") << "\n";
    chunks += e.chunks.size();
  }
  if (verify) {
    for (const auto& [key, e] : m.entries) {
      if (e.is_bytes)
        r.read_bytes(key);
      else
        r.read_tensor(key);
    }
    out << "  verified: every chunk of " << chunks << " matches its CRC-32\n";
  }
  return out.str();
}

// ---- any form in, any form out --------------------------------------------------------------

namespace {

std::string dtype_name_of(at::ScalarType t) {
  if (t == at::kFloat) return "float32";
  if (t == at::kBFloat16) return "bfloat16";
  if (t == at::kHalf) return "float16";
  throw UserError(std::string("checkpoint tool: model tensors of dtype ") + c10::toString(t) +
                  " cannot be exported (float32, bfloat16, float16)");
}

at::ScalarType scalar_type_named(const std::string& d) {
  if (d == "float64") return at::kDouble;
  if (d == "int64") return at::kLong;
  if (d == "int32") return at::kInt;
  if (d == "uint8") return at::kByte;
  return export_dtype(d);
}

// A .pt file's bytes, checked as a zip archive (as every .pt written by torch.save since
// PyTorch 1.6, by LibTorch's pickle_save and by ctitan is), then unpickled by LibTorch, which
// reads both torch.save's plain-dict form and the TorchScript-tagged one earlier ctitan
// versions wrote (not a top-level OrderedDict). A damaged or unreadable file is one UserError
// line.
c10::IValue load_pt(const std::string& path) {
  std::vector<char> bytes;
  {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) throw RuntimeFailure("checkpoint tool: cannot open " + path);
    bytes.resize(static_cast<size_t>(f.tellg()));
    f.seekg(0);
    if (!f.read(bytes.data(), static_cast<std::streamsize>(bytes.size())))
      throw RuntimeFailure("checkpoint tool: cannot read " + path);
  }
  const std::string what = "checkpoint tool: " + path + " is not a readable .pt file";
  if (bytes.empty()) throw UserError(what + ": the file is empty");
  if (!torch_save::looks_like_zip(bytes.data(), bytes.size()))
    throw UserError(what +
                    ": not a zip archive (torch.save writes one since PyTorch 1.6; its older format is not read)");
  for (const auto& r : torch_save::check_archive(bytes.data(), bytes.size(), what)) {
    // LibTorch's unpickler reads a top-level collections.OrderedDict as None: say so.
    static const std::string kOrderedDict = std::string("\x80\x02", 2) + "ccollections\nOrderedDict\n";
    if (r.name == "data.pkl" && r.size >= kOrderedDict.size() &&
        std::equal(kOrderedDict.begin(), kOrderedDict.end(),
                   bytes.begin() + static_cast<std::ptrdiff_t>(r.data_offset)))
      throw UserError(what +
                      ": it holds a collections.OrderedDict (as torch.save(model.state_dict()) writes), "
                      "which is not read here; save a plain dict: torch.save(dict(state_dict), path)");
  }
  auto first_line = [](std::string s) {
    s = s.substr(0, s.find('\n'));
    return s.size() > 300 ? s.substr(0, 300) + "..." : s;
  };
  try {
    return torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    throw UserError(what + ": " + first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw UserError(what + ": " + first_line(e.what()));
  }
}

// Whether the parameters of `name`'s flavor f have exactly these shapes.
bool flavor_matches(const std::string& name, const std::string& f,
                    const std::map<std::string, std::vector<int64_t>>& shapes, const HFAdapter& families) {
  const ParamList want = families.params(families.config_for(name, f, shapes.at("tok_embeddings.weight").at(0)));
  return std::map<std::string, std::vector<int64_t>>(want.begin(), want.end()) == shapes;
}

// The flavor of `name` whose parameters have exactly these shapes.
std::string flavor_from_shapes(const std::string& name, const std::map<std::string, std::vector<int64_t>>& shapes,
                               const std::string& what, const HFAdapter& families) {
  if (!shapes.count("tok_embeddings.weight"))
    throw UserError("checkpoint tool: " + what + " has no tok_embeddings.weight");
  for (const auto& f : families.flavors(name))
    if (flavor_matches(name, f, shapes, families)) return f;
  throw UserError("checkpoint tool: the tensors of " + what + " match no " + name + " flavor; pass --flavor");
}

// The family of tensors that do not record one (a DCP folder, a .pt): name_arg when given;
// else, without --flavor, the first registered family with a flavor of exactly these shapes;
// else the first registered family whose blocks these parameters belong to (the adapter's
// answer, HFAdapter::family_of_params).
std::string family_from_shapes(const std::map<std::string, std::vector<int64_t>>& shapes, const std::string& name_arg,
                               const std::string& flavor_arg, const HFAdapter& families) {
  if (!name_arg.empty()) return name_arg;
  if (flavor_arg.empty() && shapes.count("tok_embeddings.weight"))
    for (const auto& name : families.families)
      for (const auto& f : families.flavors(name))
        if (flavor_matches(name, f, shapes, families)) return name;
  std::vector<std::string> fqns;
  for (const auto& kv : shapes) fqns.push_back(kv.first);
  return families.family_of_params(fqns);
}

// The family an HF folder is loaded as: --model when given (it must load the folder's
// architecture); else the one ctitan's export recorded ("ctitan.model" = "<name> <flavor>")
// when registered with that architecture; else the architecture's default family
// (HFAdapter::family_of).
std::string hf_family(const HFModelConfig& c, const std::map<std::string, std::string>& metadata,
                      const std::string& name_arg, const HFAdapter& families) {
  std::string name = name_arg;
  if (name.empty())
    if (auto it = metadata.find("ctitan.model"); it != metadata.end()) {
      const std::string recorded = it->second.substr(0, it->second.find(' '));
      const auto& known = families.families;
      if (std::find(known.begin(), known.end(), recorded) != known.end() &&
          families.architecture_of(recorded) == c.architecture)
        name = recorded;
    }
  if (name.empty()) return families.family_of(c.architecture);
  const std::string architecture = families.architecture_of(name);
  if (architecture != c.architecture)
    throw UserError("checkpoint tool: --model " + name + " is a " + architecture + ", the HF folder holds a " +
                    c.architecture);
  return name;
}

// "step-<N>" -> N, else -1.
int64_t step_of_folder_name(const std::string& path) {
  static const std::regex re("step-([0-9]+)");
  std::smatch m;
  const std::string name = fs::path(path).filename().string();
  return std::regex_match(name, m, re) ? std::stoll(m[1]) : -1;
}

// torch.save's format (checkpoint/torch_save.h), one tensor in memory at a time; each tensor
// in `dtype`, or as stored when "".
void write_consolidated(const ModelTensors& m, const std::string& out_file, const std::string& dtype) {
  std::vector<torch_save::TensorSpec> specs;
  for (const auto& [fqn, shape] : m.params) specs.push_back({fqn, dtype.empty() ? m.dtype_of(fqn) : dtype, shape});
  torch_save::Writer w(out_file, specs);
  for (const auto& s : specs) {
    const at::Tensor t = m.read(s.name).to(scalar_type_named(s.dtype)).contiguous();
    TORCH_CHECK(t.sizes().vec() == s.shape, "[checkpoint tool] ", s.name, " read with shape ", t.sizes(), ", declared ",
                shape_str(s.shape));
    w.write(s.name, t.data_ptr(), t.nbytes());
  }
  w.commit();
}

// Writes into <out>.partial, then renames: <out> appears complete or not at all.
void write_hf(const ModelTensors& m, const std::string& out, const std::string& dtype, const HFAdapter& families) {
  std::error_code ec;
  if (fs::exists(out, ec) && !fs::is_empty(out, ec))
    throw UserError("checkpoint tool: " + out + " exists and is not empty; choose a new folder");
  const std::string stage = fs::path(out).lexically_normal().string() + ".partial";
  fs::remove_all(stage);
  fs::create_directories(stage);
  const int64_t vocab =
      std::map<std::string, std::vector<int64_t>>(m.params.begin(), m.params.end()).at("tok_embeddings.weight").at(0);
  const HFModelConfig c = m.hf_config ? *m.hf_config : families.config_for(m.model_name, m.flavor, vocab);
  write_hf_files(stage, c, m.params, dtype.empty() ? m.dtype : dtype, m.read,
                 {{"ctitan.model", m.model_name + " " + m.flavor}, {"ctitan.step", std::to_string(m.step)}}, families);
  fs::remove(out, ec);
  fs::rename(stage, out);
  ckpt::fsync_dir(fs::absolute(out).parent_path().string());
}

// A one-rank, model-only checkpoint at <parent>/step-<N> (the normal save path).
void write_sharded(const ModelTensors& m, const std::string& out, const std::string& dtype) {
  const int64_t step = step_of_folder_name(out);
  if (step < 0)
    throw UserError("checkpoint tool: a sharded checkpoint is written as a folder named step-<N> (e.g. " +
                    (fs::path(out).parent_path() / "step-0").string() + "), not " + out);
  std::error_code ec;
  if (fs::exists(out, ec)) throw UserError("checkpoint tool: " + out + " exists; choose a new folder");
  std::vector<ShardedParam> params;
  for (const auto& [fqn, shape] : m.params) {
    at::Tensor t = m.read(fqn).contiguous();
    params.push_back({fqn, t, shape, 0, shape.empty() ? 1 : shape[0]});
  }
  ModelState ms(params, true);
  if (!dtype.empty()) ms.set_export_dtype(dtype);
  CheckpointOptions o;
  o.enable = true;
  o.folder = fs::path(out).parent_path().string();
  o.model_name = m.model_name;
  o.model_flavor = m.flavor;
  CheckpointManager mgr(o, CheckpointComm::single_process());
  mgr.add("model", &ms);
  mgr.save_to(o.folder, step, /*model_only=*/true);
}

}  // namespace

int64_t ModelTensors::vocab_size() const {
  for (const auto& [fqn, shape] : params)
    if (fqn == "tok_embeddings.weight") return shape.at(0);
  throw UserError("checkpoint tool: the model holds no tok_embeddings.weight");
}

namespace {

// A ctitan or DCP step folder.
ModelTensors open_sharded(const std::string& path, const std::string& name_arg, const std::string& flavor_arg,
                          const HFAdapter& families) {
  ModelTensors m;
  auto r = std::make_shared<CheckpointReader>(path);
  m.form = "sharded";
  m.model_name = r->meta().model_name;
  m.flavor = r->meta().model_flavor;
  m.step = r->meta().step;
  for (const auto& [key, e] : r->meta().entries)
    if (!e.is_bytes && is_model_key(key)) m.params.push_back({key, e.shape});
  if (!r->has("tok_embeddings.weight")) throw UserError("checkpoint tool: " + path + " holds no model tensors");
  if (m.model_name.empty()) {  // a DCP folder records no model: --model / --flavor, else the shapes
    const std::map<std::string, std::vector<int64_t>> shapes(m.params.begin(), m.params.end());
    m.model_name = family_from_shapes(shapes, name_arg, flavor_arg, families);
    m.flavor = flavor_arg.empty() ? flavor_from_shapes(m.model_name, shapes, path, families) : flavor_arg;
  }
  // The metadata lists entries by name; a known model's own parameter order (its
  // state_dict's, as the HF and .pt forms give it) when it holds exactly those tensors.
  try {
    ParamList model_order =
        families.params(families.config_for(m.model_name, m.flavor, r->entry("tok_embeddings.weight").shape.at(0)));
    if (std::is_permutation(model_order.begin(), model_order.end(), m.params.begin(), m.params.end()))
      m.params = std::move(model_order);
  } catch (const std::exception&) {
    // another model (a test's, say): metadata order
  }
  m.dtype = r->entry("tok_embeddings.weight").dtype;
  m.read = [r](const std::string& fqn) { return r->read_tensor(fqn); };
  m.dtype_of = [r](const std::string& fqn) { return r->entry(fqn).dtype; };
  return m;
}

// A folder of safetensors files with a config.json.
ModelTensors open_hf(const std::string& path, const std::string& name_arg, const std::string& flavor_arg,
                     const HFAdapter& families) {
  ModelTensors m;
  auto hf = std::make_shared<HFCheckpoint>(path, families);
  m.form = "hf";
  m.hf_config = hf->config();
  m.model_name = hf_family(hf->config(), hf->metadata(), name_arg, families);
  if (auto it = hf->metadata().find("ctitan.model");
      it != hf->metadata().end() && it->second.find(' ') != std::string::npos)
    m.flavor = it->second.substr(it->second.find(' ') + 1);
  if (auto it = hf->metadata().find("ctitan.step"); it != hf->metadata().end()) m.step = std::atoll(it->second.c_str());
  if (m.flavor.empty()) m.flavor = find_flavor(hf->config(), families, m.model_name);
  if (m.flavor.empty() && flavor_arg.empty() && name_arg.empty())  // another family of the architecture?
    for (const auto& name : families.families)
      if (families.architecture_of(name) == hf->config().architecture && m.flavor.empty()) {
        m.flavor = find_flavor(hf->config(), families, name);
        if (!m.flavor.empty()) m.model_name = name;
      }
  if (!flavor_arg.empty()) m.flavor = flavor_arg;
  if (m.flavor.empty())
    throw UserError("checkpoint tool: " + path + "/config.json matches no " + m.model_name + " flavor; pass --flavor");
  m.params = families.params(hf->config());
  for (const auto& [fqn, shape] : m.params) hf->check_param(fqn, shape);
  const std::string st =
      hf->info(families.pieces(m.params.front().first, m.params.front().second, hf->config())[0].key).dtype;
  m.dtype = st == "BF16" ? "bfloat16" : st == "F16" ? "float16" : "float32";  // F64 is exported as float32
  m.read = [hf, shapes = std::map<std::string, std::vector<int64_t>>(m.params.begin(), m.params.end())](
               const std::string& fqn) { return hf->read_param(fqn, shapes.at(fqn)); };
  m.dtype_of = [hf, pieces = families.pieces,
                shapes = std::map<std::string, std::vector<int64_t>>(m.params.begin(), m.params.end())](
                   const std::string& fqn) {  // read_param's dtype: the first piece's
    const std::string st = hf->info(pieces(fqn, shapes.at(fqn), hf->config())[0].key).dtype;
    return st == "BF16" ? "bfloat16" : st == "F16" ? "float16" : st == "F64" ? "float64" : "float32";
  };
  return m;
}

// A consolidated .pt (a dict of tensors).
ModelTensors open_consolidated(const std::string& path, const std::string& name_arg, const std::string& flavor_arg,
                               const HFAdapter& families) {
  ModelTensors m;
  const c10::IValue v = load_pt(path);
  if (!v.isGenericDict()) throw UserError("checkpoint tool: " + path + " does not hold a dict of tensors");
  auto dict = std::make_shared<std::map<std::string, at::Tensor>>();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.key().isString() || !kv.value().isTensor())
      throw UserError("checkpoint tool: " + path + " holds an entry that is not a string -> tensor pair");
    const std::string k = kv.key().toStringRef();
    (*dict)[k] = kv.value().toTensor();
    shapes[k] = kv.value().toTensor().sizes().vec();
  }
  m.form = "consolidated";
  m.model_name = family_from_shapes(shapes, name_arg, flavor_arg, families);
  m.flavor = flavor_arg.empty() ? flavor_from_shapes(m.model_name, shapes, path, families) : flavor_arg;
  const ParamList want =
      families.params(families.config_for(m.model_name, m.flavor, shapes["tok_embeddings.weight"].at(0)));
  for (const auto& [fqn, shape] : want) {
    if (!dict->count(fqn)) throw UserError("checkpoint tool: " + path + " has no " + fqn);
    m.params.push_back({fqn, shapes[fqn]});
  }
  m.dtype = dtype_name_of(dict->at("tok_embeddings.weight").scalar_type());
  m.read = [dict](const std::string& fqn) { return dict->at(fqn); };
  m.dtype_of = [dict](const std::string& fqn) {
    const at::ScalarType t = dict->at(fqn).scalar_type();
    return t == at::kDouble ? std::string("float64") : dtype_name_of(t);
  };
  return m;
}

}  // namespace

ModelTensors open_model(const std::string& path, const std::string& name_arg, const std::string& flavor_arg,
                        const HFAdapter& families) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw UserError("checkpoint tool: " + path + " does not exist");
  if (fs::is_directory(path, ec) && (fs::exists(fs::path(path) / "metadata", ec) || dcp::is_dcp_folder(path)))
    return open_sharded(path, name_arg, flavor_arg, families);
  if (is_hf_folder(path)) return open_hf(path, name_arg, flavor_arg, families);
  if (fs::is_regular_file(path, ec)) return open_consolidated(path, name_arg, flavor_arg, families);
  throw UserError("checkpoint tool: " + path +
                  " is neither a checkpoint step folder, an HF safetensors folder nor a consolidated .pt file");
}

void export_consolidated(const std::string& step_path, const std::string& out_file, const std::string& dtype,
                         const HFAdapter& families) {
  CheckpointReader check(step_path);  // a missing or incomplete step folder is reported as such
  write_consolidated(open_model(step_path, "", "", families), out_file, dtype);
}

std::string convert_checkpoint(const std::string& src, const std::string& dst, std::string to, const std::string& dtype,
                               const std::string& model, const std::string& flavor, const HFAdapter& families) {
  if (!dtype.empty()) export_dtype(dtype);  // validates
  if (to.empty()) {
    if (fs::path(dst).extension() == ".pt")
      to = "consolidated";
    else if (step_of_folder_name(dst) >= 0)
      to = "sharded";
    else
      to = "hf";
  }
  const ModelTensors m = open_model(src, model, flavor, families);
  if (to == "consolidated")
    write_consolidated(m, dst, dtype);
  else if (to == "hf")
    write_hf(m, dst, dtype, families);
  else if (to == "sharded")
    write_sharded(m, dst, dtype);
  else
    throw UserError("checkpoint tool: --to " + to + " is not one of: sharded, consolidated, hf");
  return m.form + " " + m.model_name + " \"" + m.flavor + "\" (" + std::to_string(m.params.size()) + " tensors, " +
         (dtype.empty() ? m.dtype : dtype) + ") -> " + to + " " + dst +
         (to == "consolidated" ? std::string(" (") + kPtLoadNote + ")" : "");
}

std::string inspect_hf(const std::string& path, bool verify, const HFAdapter& families) {
  HFCheckpoint hf(path, families);
  const HFModelConfig& c = hf.config();
  std::ostringstream out;
  out << "HF safetensors checkpoint " << path << "\n"
      << "  " << c.architecture << ": hidden " << c.hidden_size << ", layers " << c.num_hidden_layers << ", heads "
      << c.num_attention_heads << " (kv " << c.num_key_value_heads << "), intermediate " << c.intermediate_size
      << ", vocab " << c.vocab_size;
  out << families.describe(c);
  const std::string scaling = c.rope_scaling ? std::string(" (") + kHfRopeScalingType + " scaling)" : "";
  out << "\n  rope_theta " << c.rope_theta << scaling << ", rms_norm_eps " << c.rms_norm_eps << ", torch_dtype "
      << c.torch_dtype << "\n";
  for (const auto& [k, v] : hf.metadata()) out << "  metadata " << k << " = " << v << "\n";
  const std::string family = hf_family(c, hf.metadata(), "", families);
  const std::string flavor = find_flavor(c, families, family);
  out << "  ctitan model: " << family << " " << (flavor.empty() ? "(no matching flavor)" : flavor) << "\n";
  const auto keys = hf.keys();
  uint64_t bytes = 0;
  for (const auto& k : keys) bytes += hf.info(k).end - hf.info(k).begin;
  out << "  " << keys.size() << " tensors, " << bytes << " bytes\n";
  for (const auto& k : keys) {
    const auto& t = hf.info(k);
    out << "  " << k << "  " << t.dtype << " " << shape_str(t.shape) << "  "
        << fs::path(hf.file_of(k)).filename().string() << "\n";
  }
  if (fs::exists(fs::path(path) / "COMPLETE")) {
    const int64_t step = step_of_folder_name(path);
    const std::string why = step >= 0 ? ckpt::incomplete_reason(path, step) : "not in a step-<N> folder";
    out << "  COMPLETE marker: " << (why.empty() ? "valid" : "INVALID: " + why) << "\n";
  }
  if (verify) {
    for (const auto& [fqn, shape] : families.params(c)) hf.check_param(fqn, shape);
    for (const auto& k : keys) hf.read(k);
    out << "  verified: every file's header is valid, every tensor readable, every ctitan parameter present\n";
  }
  return out.str();
}

}  // namespace ctitan
