#include "core/ragged/plan.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <unordered_set>

#include "core/ragged/int_math.h"

namespace rfsdp {

int64_t align_elems_for(int64_t align_bytes, int64_t elem_bytes) {
  if (align_bytes < 1) throw std::invalid_argument("align_bytes must be positive");
  if (elem_bytes < 1) throw std::invalid_argument("dtype_bytes must be positive");
  return std::lcm(align_bytes, elem_bytes) / elem_bytes;
}

int64_t Plan::align_elems() const { return align_elems_for(align_bytes, elem_bytes); }

int64_t Plan::total_tensor_elems() const {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

int64_t Plan::lower_bound_shard_elems() const {
  return round_up(ceil_div(total_tensor_elems(), world_size), align_elems());
}

double Plan::padding_fraction() const {
  const int64_t total = buffer_elems();
  if (total == 0) return 0.0;
  return static_cast<double>(total - total_tensor_elems()) / static_cast<double>(total);
}

int64_t Plan::buffer_shard(size_t b) const {
  if (b >= num_buffers()) throw std::out_of_range("buffer index out of range");
  return buffer_shard_elems.empty() ? shard_elems : buffer_shard_elems[b];
}

int64_t Plan::buffer_local_begin(size_t b) const {
  if (b >= num_buffers()) throw std::out_of_range("buffer index out of range");
  int64_t begin = 0;
  for (size_t c = 0; c < b; ++c) begin += buffer_shard_elems[c];
  return begin;
}

size_t Plan::buffer_index(size_t tensor) const {
  if (tensor >= tensors.size()) throw std::out_of_range("tensor index out of range");
  return buffer_of.empty() ? 0 : static_cast<size_t>(buffer_of[tensor]);
}

int64_t Plan::global_offset(size_t tensor) const {
  return buffer_global_begin(buffer_index(tensor)) + offsets.at(tensor);
}

ShardRange Plan::shard(size_t tensor, int64_t rank) const {
  if (tensor >= tensors.size()) throw std::out_of_range("tensor index out of range");
  if (rank < 0 || rank >= world_size) {
    throw std::out_of_range("rank " + std::to_string(rank) + " out of range for world size " +
                            std::to_string(world_size));
  }
  const TensorSpec& t = tensors[tensor];
  const size_t b = buffer_index(tensor);
  const int64_t shard_elems = buffer_shard(b);  // this buffer's S_b
  const int64_t off = offsets[tensor];
  const int64_t lo = std::max(off, rank * shard_elems);
  const int64_t hi = std::min(off + t.numel(), (rank + 1) * shard_elems);
  ShardRange r;
  if (lo >= hi) {
    // Empty piece: place it at the row where the tensor would continue.
    const int64_t row = lo >= off + t.numel() ? t.rows() : 0;
    r.row_begin = r.row_end = row;
    r.local_offset = 0;
    return r;
  }
  // Valid plans cut only at granule (hence row) edges, so these divide exactly.
  r.row_begin = (lo - off) / t.row_elems();
  r.row_end = hi == off + t.numel() ? t.rows() : (hi - off) / t.row_elems();
  r.local_offset = buffer_local_begin(b) + lo - rank * shard_elems;
  r.numel = hi - lo;
  return r;
}

std::vector<std::string> plan_violations(const Plan& plan) {
  std::vector<std::string> bad;
  auto tensor_msg = [](const TensorSpec& t, const std::string& what) {
    return "tensor '" + t.name + "': " + what;
  };
  if (plan.world_size < 1) {
    bad.push_back("world_size must be >= 1, got " + std::to_string(plan.world_size));
    return bad;
  }
  if (plan.offsets.size() != plan.tensors.size()) {
    bad.push_back("plan has " + std::to_string(plan.offsets.size()) + " offsets for " +
                  std::to_string(plan.tensors.size()) + " tensors");
    return bad;
  }
  int64_t align = 0;
  try {
    align = plan.align_elems();
  } catch (const std::invalid_argument& e) {
    bad.push_back(e.what());
    return bad;
  }
  const size_t nb = plan.num_buffers();
  if (!plan.buffer_of.empty() && plan.buffer_of.size() != plan.tensors.size()) {
    bad.push_back("plan has " + std::to_string(plan.buffer_of.size()) + " buffer indices for " +
                  std::to_string(plan.tensors.size()) + " tensors");
    return bad;
  }
  for (size_t i = 0; i < plan.buffer_of.size(); ++i) {
    if (plan.buffer_of[i] < 0 || static_cast<size_t>(plan.buffer_of[i]) >= nb) {
      bad.push_back(tensor_msg(plan.tensors[i], "buffer " + std::to_string(plan.buffer_of[i]) +
                                                    " does not exist (the plan has " +
                                                    std::to_string(nb) + ")"));
      return bad;
    }
  }
  int64_t sum_s = 0;
  for (size_t b = 0; b < nb; ++b) {
    const int64_t S = plan.buffer_shard(b);
    const std::string which = nb == 1 ? "S" : "S of buffer " + std::to_string(b);
    if (S < 1) {
      bad.push_back(which + " (elements per rank) must be positive, got " + std::to_string(S));
      return bad;
    }
    if (S % align != 0) {
      bad.push_back("alignment: " + which + " = " + std::to_string(S) + " is not a multiple of " +
                    std::to_string(align) + " elements (" + std::to_string(plan.align_bytes) +
                    " bytes)");
    }
    sum_s += S;
  }
  if (sum_s != plan.shard_elems) {
    bad.push_back("the buffers' S add up to " + std::to_string(sum_s) + ", not the plan's S = " +
                  std::to_string(plan.shard_elems));
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorSpec& t = plan.tensors[i];
    try {
      check_tensor_spec(t);
    } catch (const std::invalid_argument& e) {
      bad.push_back(e.what());
      continue;
    }
    if (t.elem_bytes != plan.elem_bytes) {
      bad.push_back(tensor_msg(t, "dtype_bytes " + std::to_string(t.elem_bytes) +
                                      " differs from the buffer's " +
                                      std::to_string(plan.elem_bytes)));
    }
    const int64_t off = plan.offsets[i];
    const int64_t n = t.numel();
    const int64_t S = plan.buffer_shard(plan.buffer_index(i));
    if (off < 0 || off + n > plan.world_size * S) {
      bad.push_back(tensor_msg(t, "bounds: [" + std::to_string(off) + ", " +
                                      std::to_string(off + n) + ") lies outside the buffer of " +
                                      std::to_string(plan.world_size * S) + " elements"));
      continue;
    }
    if (off % align != 0) {
      bad.push_back(tensor_msg(t, "alignment: offset " + std::to_string(off) +
                                      " is not a multiple of " + std::to_string(align) +
                                      " elements"));
    }
    // Rank boundaries strictly inside the tensor must fall on granule edges.
    const int64_t G = t.granule_elems();
    for (int64_t k = off / S + 1; k * S < off + n; ++k) {
      const int64_t cut = k * S - off;
      if (cut % G != 0) {
        bad.push_back(tensor_msg(
            t, "granule: rank boundary " + std::to_string(k) + " falls " + std::to_string(cut) +
                   " elements into the tensor, not a multiple of its granule of " +
                   (t.is_whole() ? std::string("the whole tensor")
                                 : std::to_string(t.effective_granule_rows()) + " rows") +
                   " (" + std::to_string(G) + " elements)"));
        break;
      }
    }
  }
  std::unordered_set<std::string> names;
  for (const TensorSpec& t : plan.tensors) {
    if (!names.insert(t.name).second) bad.push_back(tensor_msg(t, "duplicate name"));
  }
  // Overlap: sort by (buffer, offset), compare neighbours in one buffer.
  std::vector<size_t> order(plan.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t ba = plan.buffer_index(a), bb = plan.buffer_index(b);
    return ba != bb ? ba < bb : plan.offsets[a] < plan.offsets[b];
  });
  for (size_t j = 1; j < order.size(); ++j) {
    const TensorSpec& prev = plan.tensors[order[j - 1]];
    const TensorSpec& cur = plan.tensors[order[j]];
    if (plan.buffer_index(order[j - 1]) != plan.buffer_index(order[j])) continue;
    if (plan.offsets[order[j - 1]] + prev.numel() > plan.offsets[order[j]]) {
      bad.push_back(tensor_msg(cur, "overlap: starts at " + std::to_string(plan.offsets[order[j]]) +
                                        ", inside tensor '" + prev.name + "' [" +
                                        std::to_string(plan.offsets[order[j - 1]]) + ", " +
                                        std::to_string(plan.offsets[order[j - 1]] + prev.numel()) +
                                        ")"));
    }
  }
  return bad;
}

void validate_plan(const Plan& plan) {
  const auto bad = plan_violations(plan);
  if (!bad.empty()) throw std::invalid_argument("invalid plan: " + bad.front());
}

std::optional<BlockCut> first_block_cut(const Plan& plan, int64_t block) {
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorSpec& t = plan.tensors[i];
    for (int64_t r = 0; r < plan.world_size; ++r) {
      const ShardRange s = plan.shard(i, r);
      if (s.empty()) continue;
      const int64_t begin = s.row_begin * t.row_elems(), end = begin + s.numel;
      if (begin % block != 0) return BlockCut{i, r, begin};
      if (end != t.numel() && end % block != 0) return BlockCut{i, r, end};
    }
  }
  return std::nullopt;
}

std::vector<int64_t> block_slots(const Plan& plan, int64_t block) {
  std::vector<std::vector<int64_t>> count(plan.num_buffers(), std::vector<int64_t>(plan.world_size, 0));
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    for (int64_t r = 0; r < plan.world_size; ++r) {
      count[plan.buffer_index(i)][r] += (plan.shard(i, r).numel + block - 1) / block;
    }
  }
  std::vector<int64_t> slots;
  for (const auto& c : count) slots.push_back(*std::max_element(c.begin(), c.end()));
  return slots;
}

}  // namespace rfsdp
