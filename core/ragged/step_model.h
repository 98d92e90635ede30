// What one training step of an FSDP unit sends from each rank, from its plan,
// and a modelled time for it: the one home of these formulas (FSDPUnit counts
// what it sends with them, rfsdp-plan --report and the benches print them).
//
// A step gathers each unit twice (forward, and backward after the forward's
// reshard) and reduce-scatters its gradients once. Per rank and collective, the
// bytes sent are this rank's slice to each of the m - 1 others (ring and
// all-to-all algorithms alike): weights S x (bytes an element on the wire) plus,
// for block codes, one fp32 scale per slot (block_slots); gradients S x (bytes of
// the wire's gradient dtype); under HSDP the reduced slice then goes to each of
// the r - 1 other replicas.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/ragged/plan.h"

namespace rfsdp {

// What travels: weights as elements of weight_bytes (2: bf16, the plan's own
// size) or as block codes (code_block > 0: 1-byte codes and one fp32 scale per
// block of code_block elements, which the plan must keep whole); gradients as
// elements of grad_bytes, summed across replicas in replica_bytes.
struct WireFormat {
  int64_t weight_bytes = 2;
  int64_t code_block = 0;
  int64_t grad_bytes = 4;
  int64_t replica_bytes = 4;
  std::string describe() const;
};

// Bytes one rank sends in one all-gather of the unit's weights.
int64_t gather_bytes(const Plan& plan, const WireFormat& wire);
// Bytes one rank sends in the unit's gradient reduction: the reduce-scatter in
// its shard group, then (replicas > 1: HSDP) its slice to every other replica.
int64_t reduce_bytes(const Plan& plan, const WireFormat& wire, int64_t replicas = 1);
// A step: two gathers and one reduction.
inline int64_t step_bytes(const Plan& plan, const WireFormat& wire, int64_t replicas = 1) {
  return 2 * gather_bytes(plan, wire) + reduce_bytes(plan, wire, replicas);
}

// FSDP2 on the same tensors: each tensor's dim 0 cut into m chunks of
// ceil(dim0 / m) rows (padded), gathered into one buffer and copied out into the
// parameters, gradients copied into one buffer before the reduce-scatter.
struct Fsdp2Unit {
  int64_t shard_elems = 0;  // S: a rank's padded chunks, all tensors
  int64_t total_elems = 0;  // the tensors' elements
};
Fsdp2Unit fsdp2_unit(const std::vector<TensorSpec>& tensors, int64_t world_size);
// Bytes FSDP2 copies in one step of such a unit (weights on the wire as weight_bytes,
// gradients as grad_bytes): per gather the shard's copy-in and the unit's copy-out
// into the parameters, twice; the gradients' copy-in before the reduce-scatter.
int64_t fsdp2_copy_bytes(const Fsdp2Unit& unit, int64_t world_size, int64_t weight_bytes,
                         int64_t grad_bytes);

// The links of a cluster and the step being modelled (defaults: H200 nodes of 8
// on NVLink 4, one 400 Gb/s NIC per GPU, bf16 weights).
struct LinkModel {
  int64_t node_size = 8;
  double intra_gbps = 450;     // GB/s a GPU sends inside a node (NVLink 4: 900 GB/s both ways)
  double inter_gbps = 50;      // GB/s a GPU sends to other nodes (400 Gb/s)
  double intra_latency_us = 3;  // per ring step inside a node
  double inter_latency_us = 10; // per ring step across nodes
  double hbm_gbps = 4800;      // a copy's bytes (read + write) per second (H200 HBM3e)
  std::string describe() const;
};

// Modelled seconds of one collective that sends `bytes` from each of m ranks: a
// ring over the m ranks, bandwidth-bound by the slowest link it crosses (the NIC
// once it spans nodes), plus one latency per step (m - 1 steps).
double collective_seconds(int64_t bytes, int64_t world_size, const LinkModel& links);
// Seconds to copy `bytes` (read once, written once) in device memory.
double copy_seconds(int64_t bytes, const LinkModel& links);

}  // namespace rfsdp
