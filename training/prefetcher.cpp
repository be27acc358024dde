// Read-ahead of the training batches; see prefetcher.h.
#include "training/prefetcher.h"

#include <cstring>
#include <stdexcept>
#include <utility>

#include <c10/core/DeviceGuard.h>

namespace ctitan {

BatchPrefetcher::BatchPrefetcher(DataLoader& loader, PrefetchOptions options)
    : loader_(loader), opt_(std::move(options)) {
  if (opt_.depth < 0) throw std::logic_error("[prefetcher] depth " + std::to_string(opt_.depth) + " < 0");
}

BatchPrefetcher::~BatchPrefetcher() { stop(); }

void BatchPrefetcher::start() {
  if (started_) return;
  started_ = true;
  if (opt_.depth == 0) return;
  consumed_ = loader_.state();  // nothing trained on yet: where the loader stands now
  thread_ = std::thread([this] { produce(); });
}

BatchPrefetcher::Item BatchPrefetcher::read_one(bool with_state) {
  Item item;
  Batch b = loader_.next();
  if (with_state) item.after = loader_.state();
  const auto options = torch::TensorOptions().dtype(torch::kInt64).pinned_memory(opt_.pin);
  item.batch.inputs = torch::empty({b.batch, b.seq}, options);  // [B, T]
  item.batch.labels = torch::empty({b.batch, b.seq}, options);  // [B, T]
  std::memcpy(item.batch.inputs.data_ptr<int64_t>(), b.inputs.data(), b.inputs.size() * sizeof(int64_t));
  std::memcpy(item.batch.labels.data_ptr<int64_t>(), b.labels.data(), b.labels.size() * sizeof(int64_t));
  if (opt_.keep_tokens) item.batch.tokens = std::move(b);
  return item;
}

void BatchPrefetcher::produce() {
  // This thread's current device is the run's, as PyTorch's pin-memory thread sets it: what
  // it does with CUDA (the pinned allocations) then never touches another GPU.
  c10::OptionalDeviceGuard device_guard;
  if (opt_.device.is_cuda()) device_guard.reset_device(opt_.device);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      space_.wait(lock, [this] { return stopping_ || static_cast<int64_t>(queue_.size()) < opt_.depth; });
      if (stopping_) break;
    }
    Item item;
    try {
      item = read_one(/*with_state=*/true);
    } catch (...) {
      item = Item{};
      item.error = std::current_exception();
    }
    const bool failed = item.error != nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    ready_.notify_one();
    if (failed) break;  // nothing after a failed batch is read
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    producer_done_ = true;
  }
  ready_.notify_all();
}

BatchPrefetcher::Item BatchPrefetcher::pop_front(std::unique_lock<std::mutex>& lock) {
  Item item = std::move(queue_.front());
  queue_.pop_front();
  lock.unlock();
  space_.notify_one();
  return item;
}

BatchPrefetcher::Item BatchPrefetcher::take() {
  std::unique_lock<std::mutex> lock(mu_);
  ready_.wait(lock, [this] { return !queue_.empty() || producer_done_; });
  // The thread ends only after queueing a failure (rethrown from then on) or in stop().
  if (queue_.empty()) throw std::logic_error("[prefetcher] no batch after the reading thread ended");
  return pop_front(lock);
}

std::optional<BatchPrefetcher::Item> BatchPrefetcher::try_take() {
  std::unique_lock<std::mutex> lock(mu_);
  if (queue_.empty()) return std::nullopt;
  return pop_front(lock);
}

void BatchPrefetcher::to_device(Item& item) const {
  if (item.error) return;
  // From pinned memory on a GPU: queued on the current stream, the host does not wait. On
  // the CPU, .to(kCPU) is the tensor itself.
  item.batch.inputs = item.batch.inputs.to(opt_.device, /*non_blocking=*/true);
  item.batch.labels = item.batch.labels.to(opt_.device, /*non_blocking=*/true);
}

StepBatch BatchPrefetcher::next() {
  if (stopped_) throw std::logic_error("[prefetcher] next() after stop()");
  start();
  if (opt_.depth == 0) {  // the synchronous path: read now, on this thread
    Item item = read_one(/*with_state=*/false);
    to_device(item);
    return std::move(item.batch);
  }
  if (error_) std::rethrow_exception(error_);
  Item item;
  if (staged_) {
    item = std::move(*staged_);  // its copy was started by the previous call
    staged_.reset();
  } else {
    item = take();
    to_device(item);
  }
  if (item.error) {
    error_ = item.error;
    std::rethrow_exception(error_);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    consumed_ = std::move(item.after);
  }
  // The following batch, if it is read already: its copy now, ahead of the step that uses it.
  staged_ = try_take();
  if (staged_) to_device(*staged_);
  return std::move(item.batch);
}

void BatchPrefetcher::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  space_.notify_all();
  if (thread_.joinable()) thread_.join();
  stopped_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  queue_.clear();
  staged_.reset();
}

std::string BatchPrefetcher::state_dict() const {
  if (!started_ || opt_.depth == 0) return loader_.state_dict();
  LoaderState s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = consumed_;
  }
  return to_json(s);
}

void BatchPrefetcher::load_state_dict(const std::string& state) {
  if (started_ && opt_.depth > 0) throw std::logic_error("[prefetcher] load_state_dict() after the read-ahead started");
  loader_.load_state_dict(state);
}

std::string BatchPrefetcher::redistributed_state(const std::vector<std::string>& saved) const {
  return loader_.redistributed_state(saved);
}

int64_t BatchPrefetcher::skipped_documents() const {
  if (!started_ || opt_.depth == 0) return loader_.skipped_documents();
  std::lock_guard<std::mutex> lock(mu_);
  return consumed_.skipped;
}

}  // namespace ctitan
