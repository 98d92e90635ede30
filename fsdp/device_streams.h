// The streams FSDP units on one GPU share, and the ordering between them.
//
// All-gathers run on one side stream, reduce-scatters on another, compute on
// the current stream; CUDA events order them (no record_stream: the caching
// allocator would hold every gathered buffer until the side stream's later
// work completes, which veScale-FSDP measured as a memory cost).
//
// Memory: the caching allocator hands a freed block to the next allocation on
// the stream the block was allocated on, without waiting for other streams. A
// gathered parameter buffer is allocated on the gather stream and read on the
// compute stream, so it is not freed at once: release_after_reads() keeps it
// with an event recorded on the compute stream after its last read, and the
// gather stream waits on that event before the buffer goes back (the next
// gather, which may reuse the memory, is then ordered after the reads).
//
// Device-generic (c10::Stream / c10::Event): no CUDA headers; used only for
// non-CPU devices (a CPU unit runs its collectives synchronously in order).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <mutex>
#include <vector>

namespace rfsdp {

class DeviceStreams {
 public:
  // The one instance for `device` (a GPU; created on first use).
  static DeviceStreams& of(at::Device device);

  at::Device device() const { return device_; }
  c10::Stream gather_stream() const { return gather_; }
  c10::Stream reduce_stream() const { return reduce_; }
  c10::Stream current_stream() const;

  // An event recorded now on `stream`.
  std::shared_ptr<c10::Event> record(const c10::Stream& stream) const;
  // `waiter` waits for everything enqueued on the current stream so far.
  void wait_for_current(const c10::Stream& waiter) const;

  // Frees `memory` (a gathered buffer's storage) once the gather stream has
  // waited for the current stream's work enqueued so far (its last reads).
  void release_after_reads(at::DataPtr memory);
  // The gather stream waits for the reads of every buffer released above, then
  // the buffers go back to the allocator. Called before each gather.
  void free_released();
  size_t released_pending() const;

 private:
  explicit DeviceStreams(at::Device device);
  struct Released {
    at::DataPtr memory;
    std::shared_ptr<c10::Event> reads_done;
  };
  at::Device device_;
  c10::Stream gather_, reduce_;
  mutable std::mutex mu_;
  std::vector<Released> released_;
};

}  // namespace rfsdp
