// Offline checkpoint tools: inspect a checkpoint folder, verify every checksum, and export
// the model as one consolidated file that Python's torch.load reads.
//
//   checkpoint_tool inspect  <step folder | checkpoint folder> [--verify]
//   checkpoint_tool export   <step folder> <out.pt> [--dtype float32|bfloat16|float16]
//
// The executable is a two-line main calling checkpoint_tool_main (see the report / README).
#pragma once
#include <string>
#include <vector>

namespace ctitan {

// Step, saved world size and dp degrees, model, completeness, files, and every key with its
// rule, dtype, global shape and chunk count. verify: also reads every chunk and checks its
// CRC-32 (RuntimeFailure naming the first bad one). A folder holding step-<N> folders lists
// them with their completeness instead.
std::string inspect_checkpoint(const std::string& path, bool verify);

// The model entries (top-level keys: not optimizer./lr_scheduler./train_state./dataloader./
// rng.) as full tensors, in `dtype` ("" = as saved), pickled as a {fqn: tensor} dict with
// torch::pickle_save: Python reads it with torch.load(path). Written durably.
void export_consolidated(const std::string& step_path, const std::string& out_file, const std::string& dtype);

// argv-style entry point of the tool; returns the process exit code (0 ok, 2 usage or
// user error, 1 corrupt or I/O).
int checkpoint_tool_main(const std::vector<std::string>& args);

}  // namespace ctitan
