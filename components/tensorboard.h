// TensorBoard event files, written by ctitan itself (no TensorFlow, no libprotobuf: linking
// LibTorch's protobuf beside sentencepiece's is what datasets/spm_shim.h exists to avoid).
//
// An event file is a sequence of TFRecords:
//   uint64 length | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)
// (little-endian; masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8, CRC-32C = Castagnoli),
// each data an `Event` protobuf (tensorflow/core/util/event.proto):
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first record is the file version ("brain.Event:2"), then one Event per logged step
// holding every scalar of that step. Each Event is written with one write(2) as soon as it is
// encoded, so a TensorBoard reading the folder while the job runs sees every finished step
// (its reader waits for a record that is still incomplete).
//
// The protobuf wire format used here: a field is a key varint (field_number << 3 | wire_type)
// then its payload — wire type 0 varint, 1 fixed64, 2 length-delimited (varint length, bytes),
// 5 fixed32; fixed-size values little-endian.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ctitan {
namespace tensorboard {

// The masked CRC TFRecord stores (so that a CRC of data holding CRCs is not degenerate).
uint32_t masked_crc32c(const void* data, size_t n);

// One TFRecord around `data`.
std::string tfrecord(const std::string& data);

// Event{wall_time, file_version}, the first record of every event file.
std::string encode_file_version_event(double wall_time, const std::string& version = "brain.Event:2");
// Event{wall_time, step, Summary{Value{tag, simple_value} ...}}; values are stored as float,
// as TensorBoard's simple_value is.
std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, double>>& scalars);

}  // namespace tensorboard

// Writes one event file in `folder` (created when missing), named as TensorBoard's own
// writers name theirs: events.out.tfevents.<unix seconds>.<hostname>.<pid>.0.
class TensorBoardWriter {
 public:
  // RuntimeFailure when the folder or the file cannot be created.
  explicit TensorBoardWriter(const std::string& folder);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event for `step`, written (and in the kernel's page cache) before this returns. A
  // write that fails (disk full) is logged once and later steps are not written.
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  int fd_ = -1;
  bool failed_ = false;
  std::string path_;
};

}  // namespace ctitan
