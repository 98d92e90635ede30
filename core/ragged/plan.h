// Plan: where each tensor of a unit sits in the unit's flat buffer of m x S
// elements, and what each rank's contiguous slice [r*S, (r+1)*S) holds.
#pragma once

#include <cstdint>
#include <string>
#include <optional>
#include <vector>

#include "core/ragged/tensor_spec.h"

namespace rfsdp {

// Rank r's piece of one tensor: rows [row_begin, row_end) of the tensor (whole
// granules), stored at local_offset elements into the rank's slice. May be empty.
struct ShardRange {
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t local_offset = 0;
  int64_t numel = 0;
  bool empty() const { return row_end == row_begin; }
};

// A unit may be laid out as several flat buffers, each with its own per-rank
// size S_b and its own collective. A rank's slice is its S_b elements of every
// buffer, one after another (S = sum of S_b); the gathered memory is buffer 0's
// m x S_0 elements, then buffer 1's, and so on. Every constraint holds per buffer.
// Every tensor's offset in its buffer is a multiple of this many bytes unless a
// caller asks otherwise (16: a vector load's width, and what FSDP2 pads to).
constexpr int64_t kDefaultAlignBytes = 16;

struct Plan {
  int64_t world_size = 1;
  int64_t shard_elems = 0;  // S: one rank's slice, every buffer together
  int64_t align_bytes = kDefaultAlignBytes;
  int64_t elem_bytes = 4;
  std::vector<TensorSpec> tensors;  // in the caller's order
  std::vector<int64_t> offsets;     // element offset of tensors[i] in its buffer
  // S_b of each buffer (summing to S); empty: one buffer of S elements per rank.
  std::vector<int64_t> buffer_shard_elems;
  std::vector<int64_t> buffer_of;  // tensors[i]'s buffer; empty: every tensor in buffer 0
  double plan_seconds = 0.0;

  int64_t buffer_elems() const { return world_size * shard_elems; }  // all buffers
  size_t num_buffers() const { return buffer_shard_elems.empty() ? 1 : buffer_shard_elems.size(); }
  int64_t buffer_shard(size_t b) const;        // S_b
  int64_t buffer_local_begin(size_t b) const;  // where buffer b starts in a rank's slice
  int64_t buffer_global_begin(size_t b) const { return world_size * buffer_local_begin(b); }
  size_t buffer_index(size_t tensor) const;
  // Element offset of tensors[i] in the gathered memory (all buffers).
  int64_t global_offset(size_t tensor) const;
  // Alignment in elements: S and every offset are multiples of it.
  int64_t align_elems() const;
  int64_t total_tensor_elems() const;
  // ceil(sum n / m) rounded up to the alignment: no plan can have a smaller S.
  int64_t lower_bound_shard_elems() const;
  // (m*S - sum n) / (m*S)
  double padding_fraction() const;
  ShardRange shard(size_t tensor, int64_t rank) const;
};

// Blocks of `block` consecutive elements of each tensor, counted from the tensor's
// start (the weights' codes under a communication policy, fsdp/comm_policy.h).
// Where a rank's piece of a tensor starts or ends inside a block: {tensor, rank,
// element}; none when the plan keeps every block whole on one rank.
struct BlockCut {
  size_t tensor;
  int64_t rank, element;
};
std::optional<BlockCut> first_block_cut(const Plan& plan, int64_t block);
// The most blocks (a piece's last one may be short) any rank holds in each flat
// buffer: the slots each rank's block scales take in a gathered buffer of scales.
std::vector<int64_t> block_slots(const Plan& plan, int64_t block);

// Alignment in elements for a buffer of elem_bytes-sized elements such that
// every aligned offset is a multiple of align_bytes bytes.
int64_t align_elems_for(int64_t align_bytes, int64_t elem_bytes);

// Every way `plan` breaks the constraints of docs/design.md, one line each naming
// the tensor and the constraint; empty when the plan is valid.
std::vector<std::string> plan_violations(const Plan& plan);

// Throws std::invalid_argument with the first violation.
void validate_plan(const Plan& plan);

}  // namespace rfsdp
