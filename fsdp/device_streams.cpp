#include "fsdp/device_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <stdexcept>

namespace rfsdp {

namespace {
c10::impl::VirtualGuardImpl guard_of(at::Device d) { return c10::impl::VirtualGuardImpl(d.type()); }
}  // namespace

DeviceStreams& DeviceStreams::of(at::Device device) {
  if (device.is_cpu()) {
    throw std::logic_error("DeviceStreams: the CPU has no streams (CPU units run in order)");
  }
  if (!device.has_index()) device = guard_of(device).getDevice();
  // Never destroyed: at exit, buffers kept here must not go back to a CUDA
  // allocator that may already be gone.
  static std::mutex mu;
  static auto* all = new std::map<std::pair<int, int>, DeviceStreams*>();
  std::lock_guard<std::mutex> lock(mu);
  DeviceStreams*& slot = (*all)[{static_cast<int>(device.type()), static_cast<int>(device.index())}];
  if (!slot) slot = new DeviceStreams(device);
  return *slot;
}

DeviceStreams::DeviceStreams(at::Device device)
    : device_(device),
      gather_(guard_of(device).getStreamFromGlobalPool(device, /*isHighPriority=*/true)),
      reduce_(guard_of(device).getStreamFromGlobalPool(device, /*isHighPriority=*/true)) {}

c10::Stream DeviceStreams::current_stream() const { return guard_of(device_).getStream(device_); }

std::shared_ptr<c10::Event> DeviceStreams::record(const c10::Stream& stream) const {
  auto e = std::make_shared<c10::Event>(device_.type());
  e->record(stream);
  return e;
}

void DeviceStreams::wait_for_current(const c10::Stream& waiter) const {
  record(current_stream())->block(waiter);
}

void DeviceStreams::release_after_reads(at::DataPtr memory) {
  if (!memory) return;
  auto done = record(current_stream());
  std::lock_guard<std::mutex> lock(mu_);
  released_.push_back({std::move(memory), std::move(done)});
}

void DeviceStreams::free_released() {
  std::vector<Released> go;
  {
    std::lock_guard<std::mutex> lock(mu_);
    go.swap(released_);
  }
  for (const Released& r : go) r.reads_done->block(gather_);
  // `go` goes out of scope here: the memory returns to the gather stream's pool,
  // and every later use on that stream is ordered after the reads.
}

size_t DeviceStreams::released_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_.size();
}

}  // namespace rfsdp
