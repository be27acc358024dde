// The reader of a complete checkpoint folder: ctitan's own or a torch.distributed.checkpoint
// one, re-sliced to the rows a rank asks for.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

#include "checkpoint/format.h"

namespace ctitan {

// A complete checkpoint opened for reading. Opening checks the structure (metadata parses,
// matches the COMPLETE marker, every data file exists with its recorded size); every chunk
// read is checked against its CRC-32.
//
// A folder with a .metadata file is read as a torch.distributed.checkpoint (DCP) folder
// (checkpoint/dcp.h): written by ctitan (checkpoint.format = "dcp", its COMPLETE marker
// checked) or by PyTorch / torchtitan (no marker: DCP writes .metadata last). Its keys are
// ctitan's (torchtitan flattens the same way); a tensor's chunks may be any boxes that tile it
// exactly once (FSDP's dim-0 slices, tensor parallelism's dim-1 ones, both on a 2-D mesh),
// re-sliced like ctitan's own. torchtitan's Python ints (train_state.step,
// train_state.ntokens_seen, lr_scheduler.last_epoch = ctitan's lr_scheduler.last_step,
// dataloader.world_size) read as integer scalars; every item's archive is checked (zip
// structure, CRC-32 of its records) and unpickled with exactly the classes torch.save
// writes for it.
class CheckpointReader {
 public:
  // RuntimeFailure naming the folder and the problem.
  explicit CheckpointReader(std::string dir);
  const ckpt::Metadata& meta() const { return meta_; }
  const std::string& path() const { return dir_; }
  bool has(const std::string& key) const { return meta_.entries.count(key) > 0; }
  const ckpt::EntryMeta& entry(const std::string& key) const;  // UserError when absent
  // UserError unless `key` is a tensor of this global shape.
  void require_tensor(const std::string& key, const std::vector<int64_t>& shape) const;

  // Global rows [begin, end) of `key` into dest[0 : end-begin] (any saved sharding; dtype
  // converted), dest rows past that zeroed (FSDP padding). dest: [>= end-begin, ...]. A whole
  // chunk of whole rows is read straight into dest; a box (a DCP chunk split along dims 1..)
  // goes through a buffer.
  void read_rows(const std::string& key, int64_t begin, int64_t end, const at::Tensor& dest) const;
  at::Tensor read_tensor(const std::string& key) const;  // the whole tensor, saved dtype
  int64_t read_int(const std::string& key) const;        // a scalar integer entry
  std::string read_bytes(const std::string& key) const;
  uint64_t bytes_read() const { return bytes_read_; }  // chunk bytes read so far
  bool is_dcp() const { return dcp_; }
  // A DCP folder ctitan did not write (torchtitan's): its dataloader state is not ctitan's.
  bool is_foreign_dcp() const { return dcp_ && !dcp_by_ctitan_; }

 private:
  void open_dcp();
  std::string read_item(const ckpt::ChunkMeta& c) const;  // a DCP item's archive
  std::string item_where(const ckpt::EntryMeta& e, const ckpt::ChunkMeta& c) const;
  std::string read_chunk(const ckpt::EntryMeta& e, const ckpt::ChunkMeta& c) const;
  void read_chunk_into(const ckpt::EntryMeta& e, const ckpt::ChunkMeta& c, void* dst) const;  // CRC-checked
  std::string dir_;
  ckpt::Metadata meta_;
  mutable std::atomic<uint64_t> bytes_read_{0};
  bool dcp_ = false, dcp_by_ctitan_ = false;
};

}  // namespace ctitan
