// The checkpoint_tool executable's commands (its main is two lines calling
// checkpoint_tool_main): inspect, verify, export and convert are checkpoint/convert.h's work;
// logits runs the model (tools/inference_model.h), which the HF parity script compares with
// transformers' logits.
//
//   checkpoint_tool inspect  <step folder | checkpoint folder | HF folder> [--verify]
//   checkpoint_tool export   <step folder> <out.pt> [--dtype float32|bfloat16|float16]
//   checkpoint_tool convert  <src> <dst> [--to sharded|consolidated|hf] [--dtype D] [--model M] [--flavor F]
//   checkpoint_tool logits   <src> <t0,t1,...[;t0,t1,...]> <out.safetensors>
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ctitan {

// Runs the model held by `src` (any form) in float32 on a batch of equal-length token
// sequences and writes a safetensors file with "logits" [B, T, V] (F32) and "tokens" [B, T]
// (I64); for one sequence [T, V] and [T].
void dump_logits(const std::string& src, const std::vector<std::vector<int64_t>>& batch, const std::string& out_file);

// argv-style entry point of the tool; returns the process exit code: 0 ok; 2 a usage error
// or a bad input (UserError), a damaged .pt file included (truncated, a bad zip entry, a
// CRC-32 mismatch, an unreadable pickle); 1 a damaged checkpoint folder or an I/O failure.
int checkpoint_tool_main(const std::vector<std::string>& args);

}  // namespace ctitan
