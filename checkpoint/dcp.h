// torch.distributed.checkpoint (DCP) folders as PyTorch 2.x's FileSystemWriter writes them,
// read and written without Python. Plain C++, no LibTorch.
//
//   <folder>/.metadata            pickle of torch.distributed.checkpoint.metadata.Metadata:
//       state_dict_metadata  {key: TensorStorageMetadata(properties=TensorProperties(dtype,
//                            ...), size=torch.Size, chunks=[ChunkStorageMetadata(offsets,
//                            sizes)]) | BytesStorageMetadata()}
//       storage_data         {MetadataIndex(fqn, offset=chunk offsets | None, index):
//                            _StorageInfo(relative_path, offset, length)}
//       planner_data, storage_meta, version ("1.0.0")
//   <folder>/__<rank>_<n>.distcp  items back to back; each one is what torch.save wrote for it
//                            (FileSystemWriter's default SerializationFormat.TORCH_SAVE): a
//                            zip archive of one tensor chunk (data.pkl, data/0, ...) or of a
//                            Python object (a BytesStorageMetadata item: an int, a float, a
//                            list, bytes, ...). Offsets inside an archive count from its start.
//
// Reading never runs pickled code: .metadata goes through pickle::load with exactly the
// classes DCP writes (kMetadataGlobals), an item through check_archive (zip structure and
// CRC-32 of every record) and pickle::load with the globals torch.save writes for a tensor
// or a plain object. Anything else is one line naming the file and what was refused.
//
// ctitan writes the same layout (checkpoint.format = "dcp"): keys as in its own format, one
// __<rank>_0.distcp per rank with that rank's rows (a chunk at offsets [row_begin, 0, ...]),
// tensors as torch.save archives, byte strings as torch.save(bytes), and a COMPLETE marker
// over .metadata written last (format.h).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/pickle.h"

namespace ctitan::dcp {

constexpr const char* kMetadataFile = ".metadata";

// True when `dir` holds a .metadata file.
bool is_dcp_folder(const std::string& dir);

struct Chunk {
  std::vector<int64_t> offsets, sizes;  // of the global tensor; empty for a 0-dim tensor
  std::string file;                     // relative to the folder
  uint64_t offset = 0, length = 0;      // the item's torch.save archive in `file`
};

struct Item {
  std::string key;
  bool is_bytes = false;
  std::string dtype;          // ctitan's names (float32, bfloat16, ...); tensors only
  std::vector<int64_t> size;  // global shape; tensors only
  std::vector<Chunk> chunks;  // a bytes item: one, offsets and sizes empty
};

struct Metadata {
  std::string version;
  std::map<std::string, Item> items;
};

// Reads and checks <dir>/.metadata: the pickle (restricted), every key's chunks resolved to
// a file and byte range. RuntimeFailure "<dir>/.metadata: <problem>" when it is not one.
Metadata read_metadata(const std::string& dir);

// The .metadata pickle of `m` (protocol 2; PyTorch's pickle.load builds the same classes).
std::string metadata_pickle(const Metadata& m);

// One item's archive (its bytes from the .distcp file) → the tensor chunk's bytes into dst,
// after checking the archive, that the pickle is one tensor of `dtype` and `sizes`,
// contiguous, and that its storage holds it. RuntimeFailure "<where>: <problem>".
void read_tensor_item(const std::string& archive, const std::string& where, const std::string& dtype,
                      const std::vector<int64_t>& sizes, void* dst);
// A bytes item's archive → the Python object torch.save stored (restricted pickle; bytes
// are returned as a Bytes value).
pickle::Ptr read_object_item(const std::string& archive, const std::string& where);

// torch.save(tensor) / torch.save(int) / torch.save(bytes) archives, as FileSystemWriter
// stores items (archive name "archive", as torch.save into a stream).
std::string tensor_item(const std::string& dtype, const std::vector<int64_t>& sizes, const void* data, size_t nbytes);
std::string int_item(int64_t v);
std::string bytes_item(const std::string& b);
// torch.save of a plain Python value: None, bool, int, float, str, tuple or list of them
// (what torchtitan's optimizer param_groups and LambdaLR state hold).
std::string object_item(const pickle::Value& v);

}  // namespace ctitan::dcp
