#include "fsdp/quantized_gather.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/ragged/int_math.h"
#include "quant/ops.h"

namespace rfsdp {

QuantizedGather::QuantizedGather(const Plan& plan, int64_t rank, const CommPolicy& policy,
                                 at::Device device)
    : plan_(plan), policy_(policy), rank_(rank), device_(device) {
  if (!policy.quantised_weights()) throw std::logic_error("QuantizedGather: the weights travel in full");
  policy.check_plan(plan);
  const int64_t B = policy.weight_block, m = plan.world_size;
  const size_t nb = plan.num_buffers();
  slots_ = block_slots(plan, B);  // K_b
  slot_begin_.assign(nb, 0);      // K_0 + ... + K_{b-1}
  for (size_t b = 1; b < nb; ++b) slot_begin_[b] = slot_begin_[b - 1] + slots_[b - 1];
  scale_slots_ = slot_begin_.back() + slots_.back();
  // This rank's pieces, and every tensor's blocks' global scale slots: rank r's
  // scales of buffer b lie at m * slot_begin[b] + r * K_b, its tensors' in order.
  std::vector<std::vector<int64_t>> used(nb, std::vector<int64_t>(m, 0));
  std::vector<int64_t> index;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const size_t b = plan.buffer_index(i);
    block_begin_.push_back(static_cast<int64_t>(index.size()));
    for (int64_t r = 0; r < m; ++r) {
      const ShardRange s = plan.shard(i, r);
      const int64_t blocks = ceil_div(s.numel, B);
      const int64_t first = m * slot_begin_[b] + r * slots_[b] + used[b][r];
      for (int64_t k = 0; k < blocks; ++k) index.push_back(first + k);
      if (r == rank && !s.empty()) pieces_.push_back({b, s.local_offset, s.numel, used[b][r]});
      used[b][r] += blocks;
    }
  }
  block_begin_.push_back(static_cast<int64_t>(index.size()));
  decode_index_ = at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(device);
}

namespace {

quant::cpu::AbsmaxCode code_kind(const CommPolicy& p) {
  return p.weights == WeightWire::kInt8 ? quant::cpu::AbsmaxCode::kInt8
                                        : quant::cpu::AbsmaxCode::kFloat8E4M3FN;
}

bool on_cpu_kernels(std::initializer_list<const at::Tensor*> ts) {
  if (quant::device_generic_path()) return false;
  for (const at::Tensor* t : ts) {
    if (!t->device().is_cpu() || !t->is_contiguous()) return false;
  }
  return true;
}

}  // namespace

void QuantizedGather::encode_piece(const at::Tensor& x, int64_t block, const CommPolicy& policy,
                                   const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t n = x.numel(), full = n / block, tail = n % block;
  if (on_cpu_kernels({&x, &codes, &scales})) {
    quant::cpu::absmax_encode(x.data_ptr<float>(), n, block, code_kind(policy),
                              static_cast<uint8_t*>(codes.data_ptr()), scales.data_ptr<float>());
    return;
  }
  // Full blocks as rows of a matrix, the tail (a tensor's last block) alone.
  const auto part = [&](int64_t begin, int64_t len, int64_t rows, int64_t scale_at) {
    const at::Tensor w = x.narrow(0, begin, len).view({rows, len / rows});
    at::Tensor scale = scales.narrow(0, scale_at, rows);
    at::amax_out(scale, w.abs(), {1});
    scale.div_(policy.code_max());  // absmax / code_max in fp32
    // (a block of zeros: scale 0, and 0 / 1 makes its codes 0)
    const at::Tensor q = w / at::where(scale == 0, at::ones_like(scale), scale).unsqueeze(1);
    at::Tensor c = codes.narrow(0, begin, len).view({rows, len / rows});
    if (policy.weights == WeightWire::kInt8) {
      c.copy_(q.round_().clamp_(-127, 127));  // round half to even; integral: the cast is exact
    } else {
      c.copy_(q.clamp_(-448, 448));  // torch's cast: round to nearest even
    }
  };
  if (full > 0) part(0, full * block, full, 0);
  if (tail > 0) part(full * block, tail, 1, full);
}

CommHandle QuantizedGather::gather(Comm& comm, const at::Tensor& local) {
  at::NoGradGuard no_grad;
  const int64_t m = plan_.world_size;
  const auto on = at::TensorOptions().device(device_);
  // (Padding codes and unused scale slots travel unwritten: decode reads neither.)
  codes_ = at::empty({plan_.buffer_elems()}, on.dtype(policy_.code_dtype()));
  scales_ = at::empty({m * scale_slots_}, on.dtype(at::kFloat));
  // This rank's slots of each buffer, in place in the gathered buffers.
  std::vector<at::Tensor> my_codes, my_scales;
  for (size_t b = 0; b < plan_.num_buffers(); ++b) {
    const int64_t Sb = plan_.buffer_shard(b);
    my_codes.push_back(codes_.narrow(0, plan_.buffer_global_begin(b) + rank_ * Sb, Sb));
    my_scales.push_back(scales_.narrow(0, m * slot_begin_[b] + rank_ * slots_[b], slots_[b]));
  }
  for (const Piece& p : pieces_) {
    encode_piece(local.narrow(0, p.local_offset, p.numel), policy_.weight_block, policy_,
                 my_codes[p.buffer].narrow(0, p.local_offset - plan_.buffer_local_begin(p.buffer), p.numel),
                 my_scales[p.buffer].narrow(0, p.scale_offset, ceil_div(p.numel, policy_.weight_block)));
  }
  // Codes travel as bytes (every backend moves uint8), scales as fp32.
  std::vector<CommHandle> hs;
  for (size_t b = 0; b < plan_.num_buffers(); ++b) {
    const int64_t Sb = plan_.buffer_shard(b);
    hs.push_back(comm.all_gather_flat(
        codes_.view(at::kByte).narrow(0, plan_.buffer_global_begin(b), m * Sb)));
    hs.push_back(comm.all_gather_flat(scales_.narrow(0, m * slot_begin_[b], m * slots_[b])));
  }
  return CommHandle::all(std::move(hs));
}

void QuantizedGather::decode(const at::Tensor& out) {
  at::NoGradGuard no_grad;
  const int64_t B = policy_.weight_block;
  const at::Tensor scale = scales_.index_select(0, decode_index_);  // every block's, in order
  for (size_t i = 0; i < plan_.tensors.size(); ++i) {
    const int64_t n = plan_.tensors[i].numel(), at_ = plan_.global_offset(i);
    decode_piece(codes_.narrow(0, at_, n), scale.narrow(0, block_begin_[i], block_begin_[i + 1] - block_begin_[i]),
                 B, policy_, out.narrow(0, at_, n));
  }
  codes_ = at::Tensor();
  scales_ = at::Tensor();
}

void QuantizedGather::decode_piece(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                                   const CommPolicy& policy, const at::Tensor& out) {
  const int64_t n = codes.numel(), full = n / block, tail = n % block;
  if (on_cpu_kernels({&codes, &scales, &out})) {
    quant::cpu::absmax_decode(static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                              n, block, code_kind(policy), out.scalar_type(), out.data_ptr());
    return;
  }
  const auto part = [&](int64_t begin, int64_t len, int64_t rows, int64_t k) {
    const at::Tensor c = codes.narrow(0, begin, len).view({rows, len / rows}).to(at::kFloat);
    at::Tensor o = out.narrow(0, begin, len).view({rows, len / rows});
    o.copy_(c.mul_(scales.narrow(0, k, rows).unsqueeze(1)));  // code * scale in fp32, then the cast
  };
  if (full > 0) part(0, full * block, full, 0);
  if (tail > 0) part(full * block, tail, 1, full);
}

int64_t QuantizedGather::bytes_sent() const {
  return plan_.shard_elems * static_cast<int64_t>(c10::elementSize(policy_.code_dtype())) +
         scale_slots_ * 4;
}

}  // namespace rfsdp
