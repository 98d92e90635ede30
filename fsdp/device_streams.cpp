#include "fsdp/device_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <mutex>
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
  // Never destroyed: nothing here must run at exit, when the CUDA runtime may
  // already be gone.
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

void DeviceStreams::release_after_reads(at::DataPtr memory) const {
  if (!memory) return;
  wait_for_current(gather_);
  // `memory` goes out of scope here: back to the gather stream's pool.
}

}  // namespace rfsdp
