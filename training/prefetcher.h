// The training loop's batches, read ahead of the step that trains on them (issue 33: the host
// does not make the device wait for data).
//
// depth 0 (training.prefetch_batches = 0): next() reads its batch from the DataLoader when it
// is asked, as the loop always did. depth k >= 1: start() begins one background thread that
// reads the loader's batches, in the loader's order, into a queue of at most k, each with the
// loader's state after it (DataLoader::state()); next() takes the oldest while the thread reads
// on. Only that thread touches the loader from start() to stop().
//
// Exact resume: state_dict() is the loader's state after the last batch next() RETURNED (the
// batches trained on), not after the last one read: a checkpoint saved after step N resumes
// with the batch an uninterrupted run trains on at step N+1, at every depth (batches read
// ahead and not trained on are read again after the resume). skipped_documents() counts the
// same way.
//
// Errors: an exception while reading a batch (a malformed document under on_bad_document =
// "stop", an I/O error, the end of the data without repetition, an allocation failure) ends
// the thread and is rethrown, the same object, by the next() that would have returned that
// batch, and by every later one: the run stops at the same step with the same line as without
// read-ahead. What the loader logs while reading (a skipped document, a new epoch) is logged
// when the batch is read, up to depth + 2 batches before it is trained on.
//
// Memory: each batch is two [B, T] int64 tensors, filled by the thread that read it: pinned
// (page-locked) with `pin` (a GPU run: LibTorch's caching host allocator keeps a pinned block
// until the copies from it are done; the thread's current device is the run's GPU, as PyTorch's
// pin-memory thread sets it), plain memory on the CPU. next() returns them on `device`
// with non-blocking copies; with depth >= 1 it starts the copy of the batch after the one it
// returns, when that one is already read, so that the copy is queued before the step that uses
// it. The copies are queued on the calling thread's current stream, in order with the step's
// kernels (no side stream). On the CPU the "copy" returns the same tensors, so the CPU tests run
// this code; the GPU path is compiled in the CUDA build and has not run on a GPU.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "datasets/dataloader.h"
#include "datasets/sharding.h"

namespace ctitan {

struct PrefetchOptions {
  int64_t depth = 2;                   // batches read ahead (0: none)
  bool pin = false;                    // page-locked host tensors (a GPU run)
  torch::Device device = torch::kCPU;  // where next() returns the batches
  bool keep_tokens = false;            // keep the loader's vectors (the CTITAN_TRACE_WINDOWS trace)
};

// One batch as a step takes it.
struct StepBatch {
  torch::Tensor inputs, labels;  // [B, T] int64 on the options' device
  Batch tokens;                  // the loader's vectors, with keep_tokens only
};

class BatchPrefetcher {
 public:
  // The loader must outlive this object; its state then (e.g. a checkpoint's, loaded through
  // load_state_dict) is where the batches start.
  BatchPrefetcher(DataLoader& loader, PrefetchOptions options);
  ~BatchPrefetcher();  // stop()
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // Begins reading ahead (depth >= 1; nothing with depth 0). The first next() calls it if
  // nobody has. Repeated calls do nothing.
  void start();
  // The next batch in the loader's order; rethrows what reading it threw. std::logic_error
  // after stop().
  StepBatch next();
  // Ends the thread (after the batch it is reading, if any) and drops what was read ahead.
  // The loader is then read ahead of state_dict(), which stays the position of the batches
  // trained on; read its counters (bytes_read, documents_parsed) after this.
  void stop();

  // What a checkpoint stores (see above) and restores: load_state_dict() only before start()
  // (std::logic_error after); redistributed_state() as DataLoader's.
  std::string state_dict() const;
  void load_state_dict(const std::string& state);
  std::string redistributed_state(const std::vector<std::string>& saved) const;
  int64_t skipped_documents() const;

  int64_t depth() const { return opt_.depth; }
  const DataLoader& loader() const { return loader_; }

 private:
  struct Item {
    StepBatch batch;
    LoaderState after;  // the loader's state after this batch (depth >= 1)
    std::exception_ptr error;
  };
  Item read_one(bool with_state);                      // the loader's next batch as host tensors
  void produce();                                      // the thread
  Item pop_front(std::unique_lock<std::mutex>& lock);  // mu_ held; released, the reader woken
  Item take();                                         // the oldest read batch, waiting for it
  std::optional<Item> try_take();                      // the oldest read batch if there is one
  void to_device(Item& item) const;

  DataLoader& loader_;
  const PrefetchOptions opt_;
  bool started_ = false, stopped_ = false;
  std::thread thread_;
  mutable std::mutex mu_;  // guards what follows
  std::condition_variable ready_, space_;
  std::deque<Item> queue_;
  bool stopping_ = false, producer_done_ = false;
  LoaderState consumed_;  // the loader's state after the last batch next() returned
  // The consumer's own (not guarded): the next batch, taken early to start its copy, and the
  // error next() rethrows from then on.
  std::optional<Item> staged_;
  std::exception_ptr error_;
};

}  // namespace ctitan
