// DeviceStreams' ordering on a stand-in device: a fake guard for PrivateUse1
// whose streams and events only log what was asked of them (record, block,
// destroy), so the order of stream waits and frees is checked without a GPU.
#include <gtest/gtest.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <mutex>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "fsdp/device_streams.h"

namespace rfsdp {
namespace {

std::mutex log_mu;
std::vector<std::string> ops;  // "record E<id> on S<stream>", "S<stream> waits E<id>", "free <name>"

void log_op(const std::string& s) {
  std::lock_guard<std::mutex> lock(log_mu);
  ops.push_back(s);
}

std::vector<std::string> take_log() {
  std::lock_guard<std::mutex> lock(log_mu);
  std::vector<std::string> out;
  out.swap(ops);
  return out;
}

constexpr auto kDev = c10::DeviceType::PrivateUse1;

struct FakeGuard final : public c10::impl::DeviceGuardImplInterface {
  static inline int next_stream = 1, next_event = 1;
  static inline c10::StreamId current = 0;
  c10::DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device) const override { return {kDev, 0}; }
  c10::Device getDevice() const override { return {kDev, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, current);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, next_stream++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::Stream old(c10::Stream::UNSAFE, s.device(), current);
    current = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = new int(next_event++);
    log_op("record E" + std::to_string(*static_cast<int*>(*event)) + " on S" +
           std::to_string(stream.id()));
  }
  void block(void* event, const c10::Stream& stream) const override {
    log_op("S" + std::to_string(stream.id()) + " waits E" +
           std::to_string(*static_cast<int*>(event)));
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<int*>(event);
  }
  bool queryEvent(void*) const override { return true; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuard);

// Memory whose release is logged.
at::DataPtr memory(const std::string& name) {
  return at::DataPtr(new std::string(name), new std::string(name),
                     [](void* p) {
                       auto* s = static_cast<std::string*>(p);
                       log_op("free " + *s);
                       delete s;
                     },
                     c10::Device(kDev, 0));
}

std::string sid(const c10::Stream& s) { return "S" + std::to_string(s.id()); }

// The event a "record E<id> on S<stream>" line names.
std::string event_of(const std::string& record_line) {
  return record_line.substr(7, record_line.find(" on") - 7);
}

TEST(DeviceStreams, AReleasedBufferIsFreedOnlyAfterTheGatherStreamWaitedForItsReads) {
  DeviceStreams& ds = DeviceStreams::of(c10::Device(kDev, 0));
  EXPECT_EQ(&ds, &DeviceStreams::of(c10::Device(kDev)));  // one per device, index resolved
  const std::string gather = sid(ds.gather_stream()), reduce = sid(ds.reduce_stream());
  EXPECT_NE(gather, reduce);
  EXPECT_NE(gather, "S0");  // not the compute (current) stream
  take_log();
  ds.release_after_reads(memory("a"));
  ds.release_after_reads(at::DataPtr(nullptr, c10::Device(kDev, 0)));  // nothing to release
  // An event after the reads on the compute stream, the gather stream waits on
  // it, and only then does the memory go.
  const std::vector<std::string> log = take_log();
  ASSERT_EQ(log.size(), 3u);
  EXPECT_EQ(log[0].rfind("record ", 0), 0u) << log[0];
  EXPECT_NE(log[0].find("on S0"), std::string::npos) << log[0];
  EXPECT_EQ(log[1], gather + " waits " + event_of(log[0]));
  EXPECT_EQ(log[2], "free a");
}

TEST(DeviceStreams, SideStreamsWaitForTheComputeStreamAndHandlesOrderItAfterThem) {
  DeviceStreams& ds = DeviceStreams::of(c10::Device(kDev, 0));
  const std::string reduce = sid(ds.reduce_stream()), gather = sid(ds.gather_stream());
  take_log();
  ds.wait_for_current(ds.reduce_stream());
  std::vector<std::string> log = take_log();
  ASSERT_EQ(log.size(), 2u);
  EXPECT_NE(log[0].find("on S0"), std::string::npos) << log[0];
  EXPECT_EQ(log[1].rfind(reduce + " waits ", 0), 0u) << log[1];
  // A handle over work on the gather stream: its wait orders the current stream
  // after the event, then runs the finishing step (which sees that order).
  bool finished = false;
  CommHandle h = CommHandle::after_event(ds.record(ds.gather_stream()), "test").then([&] {
    finished = true;
    log_op("finish");
  });
  log = take_log();
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("on " + gather), std::string::npos) << log[0];
  const std::string e = event_of(log[0]);
  EXPECT_FALSE(h.waited());
  h.wait();
  EXPECT_TRUE(finished && h.waited());
  log = take_log();
  ASSERT_EQ(log.size(), 2u);
  EXPECT_EQ(log[0], "S0 waits " + e);
  EXPECT_EQ(log[1], "finish");
}

TEST(DeviceStreams, TheCpuHasNone) {
  EXPECT_THROW(DeviceStreams::of(at::kCPU), std::logic_error);
}

}  // namespace
}  // namespace rfsdp
