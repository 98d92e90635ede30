// The weights' all-gather as block codes (CommPolicy weights "int8" /
// "float8_e4m3fn", ZeRO++'s qwZ on block-aligned shards): each rank encodes its
// own slice alone, in blocks of weight_block consecutive elements of each
// tensor counted from the global tensor's start (the plan keeps blocks whole
// on ranks: CommPolicy::check_plan), with one fp32 scale absmax / code_max a
// block: int8 codes round(w / scale) (half to even) clamped to +-127,
// float8_e4m3fn codes (w / scale) cast as torch casts; a block of zeros has
// scale 0 and codes 0. Codes and scales are all-gathered in place (one buffer
// each per flat buffer), then decoded into the compute buffer: code * scale in
// fp32, cast to the compute dtype. So the gathered weights do not depend on the
// world size. Written in ATen operations: the same path on every device.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "core/comm/comm.h"
#include "core/ragged/plan.h"
#include "fsdp/comm_policy.h"

namespace rfsdp {

class QuantizedGather {
 public:
  QuantizedGather() = default;
  // Checks the plan (CommPolicy::check_plan) and lays out the scales: rank r's
  // scales of flat buffer b take K_b slots (the most blocks any rank holds in b).
  QuantizedGather(const Plan& plan, int64_t rank, const CommPolicy& policy, at::Device device);

  // Encodes `local` (this rank's fp32 slice, S elements) and all-gathers codes
  // and scales; the handle's then() must decode: call decode(out) after wait.
  // `out` is the compute buffer (m*S, any floating dtype).
  CommHandle gather(Comm& comm, const at::Tensor& local);
  // Writes every tensor's decoded weights into `out`; frees the gathered codes.
  void decode(const at::Tensor& out);

  // Bytes this rank sends in one gather (its codes and scale slots).
  int64_t bytes_sent() const;
  int64_t scale_slots() const { return scale_slots_; }  // K: every buffer's K_b together

  // The codes and scales of one piece of a tensor that starts on a block edge
  // (x: fp32, contiguous): what each rank does to its pieces.
  static void encode_piece(const at::Tensor& x, int64_t block, const CommPolicy& policy,
                           const at::Tensor& codes, const at::Tensor& scales);
  // A tensor's decoded weights (codes: its n codes; scales: its blocks' scales)
  // written into out (n elements of the compute dtype).
  static void decode_piece(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                           const CommPolicy& policy, const at::Tensor& out);
  // CPU tensors take quant/ops/absmax_codes' kernels unless the generic
  // path (ATen operations, what other devices run; bit for bit the same) is
  // chosen (quant/ops/device_path.h).

 private:
  struct Piece {           // one tensor's rows on this rank
    size_t buffer;
    int64_t local_offset;  // in the local slice
    int64_t numel;
    int64_t scale_offset;  // its first scale among this rank's K_b slots of its buffer
  };
  Plan plan_;
  CommPolicy policy_;
  int64_t rank_ = 0;
  at::Device device_ = at::kCPU;
  std::vector<int64_t> slots_;        // K_b
  std::vector<int64_t> slot_begin_;   // K_0 + ... + K_{b-1}: buffer b's first slot of a rank
  int64_t scale_slots_ = 0;           // sum of K_b
  std::vector<Piece> pieces_;         // this rank's, every buffer
  at::Tensor decode_index_;           // every tensor's blocks in order: its scales' global slots
  std::vector<int64_t> block_begin_;  // tensor i's first entry in decode_index_
  at::Tensor codes_, scales_;         // gathered (m*S codes, m*K scales); live between gather and decode
};

}  // namespace rfsdp
