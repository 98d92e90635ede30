// One of a unit's two global buffers (m*S elements: the full parameters, or the
// full gradients): its storage is allocated only while gathered, its views (the
// full tensors) stay valid objects across release and allocation, and one
// collective at a time may be in flight on it.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "core/ragged/plan.h"

namespace rfsdp {

class GatheredBuffer {
 public:
  GatheredBuffer() = default;
  // Views of every tensor of `plan` in a buffer of dtype/device; released.
  GatheredBuffer(const Plan& plan, at::TensorOptions options, std::string what);

  const at::Tensor& flat() const { return flat_; }
  const at::Tensor& view(size_t i) const { return views_.at(i); }
  bool live() const { return live_; }
  int64_t bytes() const { return live_ ? flat_.nbytes() : 0; }

  // Memory for the whole buffer (contents undefined) if it was released.
  void allocate();
  // Gives up the memory (returned: dropping it frees it; a GPU unit keeps it
  // until the reads are done, see DeviceStreams); the views stay valid objects.
  // An error while in flight.
  at::DataPtr release();

  bool in_flight() const { return in_flight_; }
  // Marks a collective on the buffer; `op` names it in the errors.
  void begin(const char* op);
  void end() { in_flight_ = false; }

 private:
  at::Tensor flat_;
  std::vector<at::Tensor> views_;
  std::string what_;
  bool live_ = false, in_flight_ = false;
};

}  // namespace rfsdp
