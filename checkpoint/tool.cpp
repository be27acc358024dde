// Inspect / verify / export; see tool.h.
#include "checkpoint/tool.h"

#include <filesystem>
#include <iostream>
#include <sstream>

#include <torch/serialize.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "config/errors.h"

namespace fs = std::filesystem;

namespace ctitan {
namespace {

bool is_model_key(const std::string& k) {
  for (const char* p : {"optimizer.", "lr_scheduler.", "train_state.", "dataloader.", "rng."})
    if (k.rfind(p, 0) == 0) return false;
  return true;
}

at::ScalarType export_dtype(const std::string& d) {
  if (d == "float32") return at::kFloat;
  if (d == "bfloat16") return at::kBFloat16;
  if (d == "float16") return at::kHalf;
  throw UserError("export dtype \"" + d + "\" is not one of: float32, bfloat16, float16");
}

}  // namespace

std::string inspect_checkpoint(const std::string& path, bool verify) {
  std::ostringstream out;
  std::error_code ec;
  if (!fs::exists(fs::path(path) / "metadata", ec) && !fs::exists(fs::path(path) / "COMPLETE", ec)) {
    const auto scan = ckpt::scan_folder(path);
    if (scan.complete.empty() && scan.incomplete.empty() && scan.staging.empty())
      throw UserError("checkpoint tool: " + path + " is neither a checkpoint nor a folder of step-<N> checkpoints");
    out << path << ":\n";
    for (int64_t s : scan.complete) out << "  step-" << s << "  complete\n";
    for (const auto& [dir, why] : scan.incomplete) out << "  " << fs::path(dir).filename().string() << "  INCOMPLETE: " << why << "\n";
    for (const auto& dir : scan.staging) out << "  " << fs::path(dir).filename().string() << "  save in progress or failed\n";
    return out.str();
  }
  CheckpointReader r(path);  // throws when incomplete or structurally damaged
  const auto& m = r.meta();
  out << "checkpoint " << path << "\n"
      << "  format version " << m.version << ", complete\n"
      << "  step " << m.step << (m.model_only ? " (model weights only)" : "") << "\n"
      << "  saved by " << m.world_size << " ranks, dp " << m.dp_replicate << " x " << m.dp_shard << "\n"
      << "  model " << m.model_name << " " << m.model_flavor << "\n";
  uint64_t total = 0;
  for (const auto& f : m.files) {
    out << "  file " << f.name << "  " << f.size << " bytes  crc32 " << ckpt::hex32(f.crc) << "\n";
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

void export_consolidated(const std::string& step_path, const std::string& out_file, const std::string& dtype) {
  CheckpointReader r(step_path);
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [key, e] : r.meta().entries) {
    if (e.is_bytes || !is_model_key(key)) continue;
    at::Tensor t = r.read_tensor(key);
    if (!dtype.empty()) t = t.to(export_dtype(dtype));
    dict.insert(key, t);
  }
  if (dict.size() == 0) throw UserError("checkpoint " + step_path + " holds no model tensors");
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  ckpt::write_file_durable(out_file, std::string(bytes.begin(), bytes.end()));
}

int checkpoint_tool_main(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: checkpoint_tool inspect <checkpoint folder> [--verify]\n"
      "       checkpoint_tool export <step folder> <out.pt> [--dtype float32|bfloat16|float16]\n";
  try {
    if (args.size() >= 2 && args[0] == "inspect" && (args.size() == 2 || (args.size() == 3 && args[2] == "--verify"))) {
      std::cout << inspect_checkpoint(args[1], args.size() == 3);
      return 0;
    }
    if (args.size() >= 3 && args[0] == "export" &&
        (args.size() == 3 || (args.size() == 5 && args[3] == "--dtype"))) {
      export_consolidated(args[1], args[2], args.size() == 5 ? args[4] : "");
      std::cout << "wrote " << args[2] << " (torch.load reads it: a dict of model tensors)\n";
      return 0;
    }
    std::cerr << usage;
    return 2;
  } catch (const UserError& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace ctitan
