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
// compute stream: release_after_reads() records an event on the compute stream
// after its last read, makes the gather stream wait on it, then frees the
// buffer. Work enqueued on the gather stream from then on (the only work that
// can reuse the block) runs after the reads; work enqueued before (a prefetch
// already in flight) does not use it. So the memory is back at once, and the
// gather stream waits for nothing it would not wait for at its next gather.
//
// Device-generic (c10::Stream / c10::Event): no CUDA headers; used only for
// non-CPU devices (a CPU unit runs its collectives synchronously in order).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>

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

  // Frees `memory` (a gathered buffer's storage, allocated on the gather stream)
  // after making the gather stream wait for the current stream's work enqueued
  // so far (the buffer's last reads).
  void release_after_reads(at::DataPtr memory) const;

 private:
  explicit DeviceStreams(at::Device device);
  at::Device device_;
  c10::Stream gather_, reduce_;
};

}  // namespace rfsdp
