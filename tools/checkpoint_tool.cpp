#include "tools/checkpoint_tool.h"

#include <filesystem>
#include <iostream>
#include <map>

#include <torch/torch.h>

#include "checkpoint/convert.h"
#include "checkpoint/hf.h"
#include "checkpoint/safetensors.h"
#include "models/hf_adapter.h"
#include "config/cli.h"
#include "config/errors.h"
#include "tools/inference_model.h"
#include "util/strings.h"

namespace fs = std::filesystem;

namespace ctitan {

void dump_logits(const std::string& src, const std::vector<std::vector<int64_t>>& batch, const std::string& out_file) {
  if (batch.empty() || batch[0].empty()) throw UserError("checkpoint tool: logits needs at least one token");
  const int64_t B = static_cast<int64_t>(batch.size()), T = static_cast<int64_t>(batch[0].size());
  for (const auto& seq : batch)
    if (static_cast<int64_t>(seq.size()) != T)
      throw UserError("checkpoint tool: the sequences of a logits batch must have the same length (" +
                      std::to_string(T) + " and " + std::to_string(seq.size()) + " tokens)");
  const ModelTensors m = open_model(src, "", "", hf_adapter());
  const int64_t vocab = m.vocab_size();
  std::vector<int64_t> flat;
  for (const auto& seq : batch)
    for (int64_t t : seq) {
      if (t < 0 || t >= vocab)
        throw UserError("checkpoint tool: token " + std::to_string(t) + " is outside the vocabulary [0, " +
                        std::to_string(vocab) + ")");
      flat.push_back(t);
    }
  const InferenceModel model = load_inference_model(m, T);
  torch::NoGradGuard no_grad;
  auto x = torch::tensor(flat, torch::kInt64).view({B, T});
  at::Tensor logits = model.forward(x).to(torch::kFloat).contiguous();  // [B, T, V]
  // One sequence: [T, V] and [T], as before batches were accepted.
  std::vector<int64_t> lshape = {B, T, vocab}, tshape = {B, T};
  if (B == 1) lshape = {T, vocab}, tshape = {T};
  safetensors::Writer w(out_file, {{"logits", "F32", lshape}, {"tokens", "I64", tshape}},
                        {{"source", src}, {"model", m.model_name + " " + m.flavor}});
  for (const auto& spec : w.order()) {
    const at::Tensor& t = spec.name == "logits" ? logits : x;
    w.write(spec.name, t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
  }
  w.commit();
}

// "1,2,3;4,5,6": sequences of token ids (logits' batch), each a comma-separated list.
static std::vector<std::vector<int64_t>> parse_token_batch(const std::string& text) {
  std::vector<std::vector<int64_t>> batch(1);
  std::string cur;
  auto flush = [&] {
    const auto v = parse_int64(cur);
    if (!v) throw UserError("checkpoint tool: \"" + cur + "\" in the token list is not an integer");
    batch.back().push_back(*v);
    cur.clear();
  };
  for (char c : text) {
    if (c == ',') {
      flush();
    } else if (c == ';') {
      flush();
      batch.emplace_back();
    } else {
      cur += c;
    }
  }
  flush();
  return batch;
}

int checkpoint_tool_main(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: checkpoint_tool inspect <checkpoint folder | step folder | HF folder> [--verify]\n"
      "       checkpoint_tool export <step folder> <out.pt> [--dtype float32|bfloat16|float16]\n"
      "       checkpoint_tool convert <src> <dst> [--to sharded|consolidated|hf] [--dtype D] [--model M] [--flavor F]\n"
      "           src: a step folder, an HF safetensors folder or a consolidated .pt file; dst form from --to,\n"
      "           else from its name (*.pt: consolidated, step-<N>: sharded, other: HF folder)\n"
      "       checkpoint_tool logits <src> <token,token,...[;token,...]> <out.safetensors>\n"
      "           runs the model (float32, one process) on the tokens; writes logits [T, V] and tokens [T]\n"
      "           (a batch of equal-length sequences separated by ';': logits [B, T, V], tokens [B, T])\n"
      "       .pt files are written as torch.save writes a dict of tensors: torch.load(path) reads them with\n"
      "           its default weights_only=True, and with mmap=True (checked with PyTorch 2.13.0+cpu); read are\n"
      "           those, earlier ctitan versions' .pt files and torch.save's of a plain dict (not an OrderedDict)\n"
      "exit status: 0 done; 2 a usage error or a bad input (a damaged .pt file included: truncated, a bad\n"
      "           zip entry, a CRC-32 mismatch); 1 a damaged checkpoint folder or an I/O failure\n";
  return run_tool([&]() -> int {
    if (args.size() >= 2 && args[0] == "inspect" && (args.size() == 2 || (args.size() == 3 && args[2] == "--verify"))) {
      const bool verify = args.size() == 3;
      std::error_code ec;
      if (is_hf_folder(args[1]) && !fs::exists(fs::path(args[1]) / "metadata", ec))
        std::cout << inspect_hf(args[1], verify, hf_adapter());
      else
        std::cout << inspect_checkpoint(args[1], verify);
      return 0;
    }
    if (args.size() >= 3 && args[0] == "export" && (args.size() == 3 || (args.size() == 5 && args[3] == "--dtype"))) {
      export_consolidated(args[1], args[2], args.size() == 5 ? args[4] : "", hf_adapter());
      std::cout << "wrote " << args[2] << ": a dict of model tensors in " << kPtLoadNote << "\n";
      return 0;
    }
    if (args.size() >= 3 && args[0] == "convert" && args.size() % 2 == 1) {
      std::map<std::string, std::string> opt;
      for (size_t i = 3; i + 1 < args.size(); i += 2) {
        if (args[i] != "--to" && args[i] != "--dtype" && args[i] != "--model" && args[i] != "--flavor") {
          std::cerr << "checkpoint_tool convert: unknown option " << args[i] << "\n" << usage;
          return 2;
        }
        opt[args[i]] = args[i + 1];
      }
      // Converted first: nothing on stdout before an error line, or before the save's log line.
      const std::string done = convert_checkpoint(args[1], args[2], opt["--to"], opt["--dtype"], opt["--model"],
                                                  opt["--flavor"], hf_adapter());
      std::cout << "converted " << done << "\n";
      return 0;
    }
    if (args.size() == 4 && args[0] == "logits") {
      const std::vector<std::vector<int64_t>> batch = parse_token_batch(args[2]);
      dump_logits(args[1], batch, args[3]);
      std::cout << "wrote " << args[3] << " (logits [" << (batch.size() > 1 ? std::to_string(batch.size()) + ", " : "")
                << batch[0].size() << ", V] float32)\n";
      return 0;
    }
    std::cerr << usage;
    return 2;
  });
}

}  // namespace ctitan
