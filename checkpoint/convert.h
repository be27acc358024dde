// Offline checkpoint work, what checkpoint_tool (tools/checkpoint_tool.h) runs: inspect a
// checkpoint folder or an HF safetensors folder, verify every checksum, convert the model
// between the three forms (sharded step folder, consolidated .pt in torch.save's format, HF
// safetensors folder); the model of any form under ctitan's names: checkpoint/model_source.h.
//
// A .pt is written by checkpoint/torch_save.h, as Python's torch.save writes a dict of
// tensors: torch.load(path) reads it with its default weights_only=True, and with mmap=True
// (checked with PyTorch 2.13.0 by tests/test_checkpoint_hf.cpp through scripts/pt_load_check.py).
// A .pt is read by LibTorch's pickle_load after checking its zip structure and CRCs: torch.save
// files of a plain dict and the TorchScript-tagged files earlier ctitan versions wrote
// (torch::pickle_save); a top-level OrderedDict (torch.save(model.state_dict())) is a UserError.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "hf_types/hf_adapter.h"

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
void export_consolidated(const std::string& step_path, const std::string& out_file, const std::string& dtype,
                         const HFAdapter& families);

// The model of `src` (step folder, HF folder or .pt file) written to `dst` in form `to`
// ("" = from dst's name: *.pt consolidated, step-<N> sharded, else HF), in `dtype` ("" = as
// stored). model / flavor: for sources that do not record them ("" = inferred from shapes, by
// the registered families of `families`). Returns a one-line summary.
std::string convert_checkpoint(const std::string& src, const std::string& dst, std::string to, const std::string& dtype,
                               const std::string& model, const std::string& flavor, const HFAdapter& families);

// Config, metadata and every tensor (name, dtype, shape, file) of an HF folder; verify: also
// reads every tensor and checks every ctitan parameter is present.
std::string inspect_hf(const std::string& path, bool verify, const HFAdapter& families);

// What the tools say about the .pt files they write: what was checked, with which PyTorch.
extern const char* const kPtLoadNote;

}  // namespace ctitan
