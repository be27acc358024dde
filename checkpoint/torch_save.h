// The .pt file Python's torch.save writes for a dict of tensors, written here without
// LibTorch's TorchScript pickler (whose type tags, torch.jit._pickle.restore_type_tag, make
// torch.load refuse the file under weights_only=True, its default since PyTorch 2.6), and a
// structural check of any .pt zip archive before it is unpickled. Plain C++, no LibTorch.
//
// The archive, as PyTorch 2.13.0's torch.save writes it (checked byte for byte, the
// serialization id included, by scripts/pt_load_check.py):
//   a zip file, every entry stored (method 0), named "<archive>/<record>" where <archive> is
//   the output file's name without folder and extension ("archive" when that is empty):
//     data.pkl                the pickle (below)
//     .format_version         "1"
//     .storage_alignment      "64"
//     byteorder               "little"
//     data/0, data/1, ...     tensor i's bytes, row-major, little endian (storage key "i")
//     version                 "3\n"
//     .data/serialization_id  20 digits of a hash of the record names, 20 of one of their CRCs
//   Each entry's data starts at a multiple of 64 bytes in the file: an extra field "FB" pads
//   the local header (what lets torch.load(path, mmap=True) map the tensors in place). Local
//   headers hold no CRC or sizes (flag bit 3, plus bit 11: UTF-8 names); a data descriptor
//   follows every non-empty entry. The zip64 end records are always written; an entry of
//   4 GiB or more, or one that starts past 4 GiB, also gets zip64 extra fields and a 24-byte
//   descriptor (miniz's writer, which PyTorch uses, does exactly this).
//
// data.pkl, pickle protocol 2, only globals that torch.load's weights_only unpickler allows:
//   a dict ({}) filled with SETITEMS (batches of 1000), name -> tensor, where
//   each tensor is torch._utils._rebuild_tensor_v2(
//       persistent id ('storage', torch.<T>Storage, "<i>", 'cpu', numel),
//       0, size tuple, stride tuple (contiguous), False, collections.OrderedDict())
//   memoised as Python's pickler memoises (every string, tuple, global and REDUCE result gets
//   a BINPUT; repeated globals and the shared 'storage' / 'cpu' strings are BINGETs).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ctitan::ckpt {
class DurableFileWriter;
}

namespace ctitan::torch_save {

// dtype: ctitan's names — float32, float64, bfloat16, float16, int64, int32, uint8.
struct TensorSpec {
  std::string name, dtype;
  std::vector<int64_t> shape;  // [] = a scalar
  int64_t numel() const;
};

// Bytes per element of a dtype above; 0 when it is not one of them.
size_t dtype_size(const std::string& dtype);

// The data.pkl record for a dict of these tensors, storage keys "0", "1", ... in order.
std::string pickle_state_dict(const std::vector<TensorSpec>& tensors);

// data.pkl of torch.save(tensor) (storage key "0"), of torch.save(int) and of
// torch.save(bytes) (protocol 2: _codecs.encode(<latin-1 text>, 'latin1')), as
// torch.distributed.checkpoint's FileSystemWriter stores a tensor chunk or a bytes item.
std::string pickle_tensor(const TensorSpec& t);
std::string pickle_int(int64_t v);
std::string pickle_bytes(const std::string& b);

// The archive name torch.save uses for `path`: its file name without extension.
std::string archive_name(const std::string& path);

// Writes a .pt file through a DurableFileWriter (temporary name, fsync, rename): the tensors
// are declared up front (data.pkl comes first), then their bytes are appended one by one in
// the declared order; commit() writes the closing records and the central directory.
// RuntimeFailure on I/O errors; std::logic_error when called out of order or with a wrong size.
class Writer {
 public:
  Writer(const std::string& path, std::vector<TensorSpec> tensors);
  // In memory: the archive is appended to *out (offsets inside it count from where it
  // starts, as torch.save into a stream positioned there), under "<archive>/", with the
  // given data.pkl; tensors' bytes follow as above. commit() finishes it (nothing to rename).
  Writer(std::string* out, const std::string& archive, const std::string& data_pkl, std::vector<TensorSpec> tensors);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  void write(const std::string& name, const void* data, size_t nbytes);
  void commit();
  uint64_t size() const;

 private:
  struct Entry {
    std::string name;
    uint64_t header_offset = 0, size = 0;
    uint32_t crc = 0;
  };
  void add_record(const std::string& record, const void* data, size_t n);
  void emit(const void* data, size_t n);

  std::string prefix_;
  std::vector<TensorSpec> tensors_;
  size_t next_ = 0;
  std::vector<Entry> entries_;
  std::vector<std::string> records_;  // record names in write order (serialization id)
  uint64_t combined_crc_ = 0;         // PyTorch's combined_uncomp_crc32_
  std::unique_ptr<ckpt::DurableFileWriter> out_;
  std::string* mem_ = nullptr;  // in-memory mode
  uint64_t base_ = 0;           // mem_->size() when the archive started
};

// One record of a zip archive, checked.
struct Record {
  std::string name;          // without the "<archive>/" prefix
  uint64_t data_offset = 0;  // in the file
  uint64_t size = 0;
};

// Checks a zip archive held in memory as PyTorch's reader needs it, before LibTorch parses
// it: the end records (zip64 included) and the central directory lie within the file, every
// entry's local header matches its central one, every entry lies before the central
// directory, stored entries' bytes match their CRC-32 (a CRC of 0 is "not recorded", as
// torch.save writes with compute_crc32 off), and all names share one "<archive>/" folder.
// UserError "<where>: <problem>" (one line) otherwise. Returns the records in directory order.
std::vector<Record> check_archive(const char* data, size_t n, const std::string& where);

// True when the bytes start like a zip archive (a local file header).
bool looks_like_zip(const char* data, size_t n);

}  // namespace ctitan::torch_save
