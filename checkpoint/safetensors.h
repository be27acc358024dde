// The safetensors file format (Hugging Face), written and read here without LibTorch:
//
//   [8 bytes]  N, the header length, unsigned little endian
//   [N bytes]  a JSON object: {"__metadata__": {str: str, ...},
//                              "<name>": {"dtype": "F32", "shape": [d0, ...],
//                                         "data_offsets": [begin, end]}, ...}
//              padded with spaces so the data starts at a multiple of 8
//   [rest]     the tensors' bytes, row-major little endian; offsets are relative to the start
//              of this section
//
// Reading is strict, as the reference implementation's validation: the header fits the
// file, is one JSON object with no duplicate or unknown fields, every dtype is known, every
// tensor's byte range is exactly numel x dtype size, and the ranges, in offset order, tile
// the data section from 0 to its end with no gap and no overlap. Every failure is one
// RuntimeFailure line "safetensors <file>: <problem>[ (tensor <name>)]".
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ctitan::ckpt {
class DurableFileWriter;
}

namespace ctitan::safetensors {

// Bytes per element of a safetensors dtype name (F32, BF16, I64, ...); 0 when unknown.
size_t dtype_size(const std::string& dtype);

struct TensorInfo {
  std::string name;
  std::string dtype;            // safetensors name: F32, BF16, F16, F64, I64, I32, ...
  std::vector<int64_t> shape;   // [] = a scalar (one element)
  uint64_t begin = 0, end = 0;  // byte range within the data section
  int64_t numel() const;
};

struct Header {
  std::string file;
  uint64_t file_size = 0;
  uint64_t data_start = 0;                                // 8 + N
  std::vector<TensorInfo> tensors;                        // in offset order
  std::map<std::string, std::string> metadata;            // __metadata__
  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
};

// Reads and validates the header of `path` (see above).
Header read_header(const std::string& path);

// Reads bytes [begin, end) of the tensor's data (begin/end relative to the tensor) into dst.
void read_bytes(const Header& h, const TensorInfo& t, uint64_t begin, uint64_t end, void* dst);

// Writes a safetensors file through a DurableFileWriter (temporary name, fsync, rename).
// The tensors are declared up front (the header holds every offset) and their bytes then
// appended in the declared order; commit() checks that every byte arrived.
struct TensorSpec {
  std::string name, dtype;
  std::vector<int64_t> shape;
};

class Writer {
 public:
  // Order of the data: as declared, except that larger element sizes come first (stable),
  // so every tensor starts at a multiple of its element size.
  Writer(std::string path, std::vector<TensorSpec> tensors, std::map<std::string, std::string> metadata);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  // The order write() expects the tensors in.
  const std::vector<TensorSpec>& order() const { return order_; }
  // Appends the next tensor's bytes (its name must be the next in order(), its size exact).
  void write(const std::string& name, const void* data, size_t nbytes);
  void commit();
  uint64_t size() const;

 private:
  std::string path_;
  std::vector<TensorSpec> order_;
  std::vector<uint64_t> sizes_;
  size_t next_ = 0;
  std::unique_ptr<ckpt::DurableFileWriter> out_;
};

}  // namespace ctitan::safetensors
