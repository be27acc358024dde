// Offline checkpoint tools: inspect a checkpoint folder or an HF safetensors folder, verify
// every checksum, convert the model between the three forms (sharded step folder,
// consolidated .pt in torch.save's format, HF safetensors folder), and run the model on given
// tokens (the HF parity script compares those logits with its own).
//
// A .pt is written by checkpoint/torch_save.h, as Python's torch.save writes a dict of
// tensors: torch.load(path) reads it with its default weights_only=True, and with mmap=True
// (checked with PyTorch 2.13.0 by tests/test_checkpoint_hf.cpp through scripts/pt_load_check.py).
// A .pt is read by LibTorch's pickle_load after checking its zip structure and CRCs: torch.save
// files of a plain dict and the TorchScript-tagged files earlier ctitan versions wrote
// (torch::pickle_save); a top-level OrderedDict (torch.save(model.state_dict())) is a UserError.
//
//   checkpoint_tool inspect  <step folder | checkpoint folder | HF folder> [--verify]
//   checkpoint_tool export   <step folder> <out.pt> [--dtype float32|bfloat16|float16]
//   checkpoint_tool convert  <src> <dst> [--to sharded|consolidated|hf] [--dtype D] [--model M] [--flavor F]
//   checkpoint_tool logits   <src> <t0,t1,...[;t0,t1,...]> <out.safetensors>
//
// The executable is a two-line main calling checkpoint_tool_main (see the report / README).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ctitan {

// Step, saved world size and dp degrees, model, completeness, files, and every key with its
// rule, dtype, global shape and chunk count. verify: also reads every chunk and checks its
// CRC-32 (RuntimeFailure naming the first bad one). A folder holding step-<N> folders lists
// them with their completeness instead.
std::string inspect_checkpoint(const std::string& path, bool verify);

// The model entries (top-level keys: not optimizer./lr_scheduler./train_state./dataloader./
// rng.) as full tensors, in `dtype` ("" = as saved), as a dict {fqn: tensor}, in model order, in
// torch.save's format (checkpoint/torch_save.h): Python reads it with torch.load(path), its
// default weights_only=True included. Written durably, one tensor in memory at a time.
void export_consolidated(const std::string& step_path, const std::string& out_file, const std::string& dtype);

// The model of `src` (step folder, HF folder or .pt file) written to `dst` in form `to`
// ("" = from dst's name: *.pt consolidated, step-<N> sharded, else HF), in `dtype` ("" = as
// stored). model / flavor: for sources that do not record them ("" = inferred from shapes).
// Returns a one-line summary.
std::string convert_checkpoint(const std::string& src, const std::string& dst, std::string to, const std::string& dtype,
                               const std::string& model, const std::string& flavor);

// Config, metadata and every tensor (name, dtype, shape, file) of an HF folder; verify: also
// reads every tensor and checks every ctitan parameter is present.
std::string inspect_hf(const std::string& path, bool verify);

// Runs the model held by `src` (any form) in float32 on a batch of equal-length token
// sequences and writes a safetensors file with "logits" [B, T, V] (F32) and "tokens" [B, T]
// (I64); for one sequence [T, V] and [T].
void dump_logits(const std::string& src, const std::vector<std::vector<int64_t>>& batch, const std::string& out_file);

// argv-style entry point of the tool; returns the process exit code: 0 ok; 2 a usage error
// or a bad input (UserError), a damaged .pt file included (truncated, a bad zip entry, a
// CRC-32 mismatch, an unreadable pickle); 1 a damaged checkpoint folder or an I/O failure.
int checkpoint_tool_main(const std::vector<std::string>& args);

}  // namespace ctitan
