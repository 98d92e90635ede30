// How the search works (docs/design.md, "The RaggedShard model"):
//
// For a fixed S and a fixed tensor order, placing each tensor at its earliest
// valid offset is optimal: a later cursor can only remove choices. The earliest
// valid offset has a closed form (earliest_offset), so one (S, order) check is
// O(tensors). A tensor crossing two or more boundaries needs S to be a multiple
// of its granule; next_candidate() uses that to skip S values no order can use.
// S grows from the lower bound; at each S a few orders are tried (all orders
// for small units), with first-fit into the padding gaps earlier tensors left.
#include "core/ragged/planner.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/ragged/int_math.h"

namespace rfsdp {

namespace {

constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

struct Item {
  int64_t n;     // elements
  int64_t G;     // granule elements
  int64_t Gp;    // lcm(G, align): spacing of aligned offsets that put a boundary on a granule edge
  size_t index;  // in the caller's order
};

// Smallest offset >= c that is aligned and puts every rank boundary strictly
// inside the tensor on a granule edge; kNone when no slice admits one.
int64_t earliest_offset(const Item& it, int64_t c, int64_t S, int64_t A) {
  c = round_up(c, A);
  // The second pass starts at a slice boundary; every later slice start behaves
  // the same as that one, so two passes decide.
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t b = (c / S + 1) * S;  // first boundary after c
    if (c + it.n <= b) return c;        // fits before it
    const int64_t j = (b - c) / it.Gp;  // largest whole number of spacings before b
    if (j >= 1) {
      const int64_t o = b - j * it.Gp;
      // Further boundaries are S apart: fine when S is a multiple of the granule.
      if (o + it.n <= b + S || S % it.G == 0) return o;
    }
    c = b;
  }
  return kNone;
}

// Places tensors one after another at their earliest valid offsets; with
// fill_gaps, a tensor first tries the padding gaps earlier ones left (the
// smallest gap it fits in: best fit), kept in a map by length.
class Placer {
 public:
  Placer(const std::vector<Item>& items, int64_t m, int64_t A) : items_(items), m_(m), A_(A) {}

  // Places items in `order` at S; fills `offsets` (by caller index) on success.
  bool place(const std::vector<size_t>& order, int64_t S, bool fill_gaps,
             std::vector<int64_t>& offsets) {
    const int64_t end = m_ * S;
    gaps_.clear();
    int64_t cursor = 0;
    for (size_t k : order) {
      const Item& it = items_[k];
      if (fill_gaps && place_in_gap(it, S, offsets)) continue;
      const int64_t o = earliest_offset(it, cursor, S, A_);
      if (o == kNone || o > end - it.n) return false;
      if (fill_gaps && o > cursor) gaps_.emplace(o - cursor, cursor);
      offsets[it.index] = o;
      cursor = o + it.n;
    }
    return true;
  }

 private:
  bool place_in_gap(const Item& it, int64_t S, std::vector<int64_t>& offsets) {
    for (auto g = gaps_.lower_bound(it.n); g != gaps_.end(); ++g) {
      const int64_t lo = g->second, hi = g->second + g->first;
      const int64_t o = earliest_offset(it, lo, S, A_);
      if (o == kNone || o > hi - it.n) continue;
      offsets[it.index] = o;
      gaps_.erase(g);
      if (o > lo) gaps_.emplace(o - lo, lo);
      if (hi > o + it.n) gaps_.emplace(hi - o - it.n, o + it.n);
      return true;
    }
    return false;
  }

  const std::vector<Item>& items_;
  int64_t m_, A_;
  std::multimap<int64_t, int64_t> gaps_;  // length -> start
};

// The smallest S' > S (a multiple of A, at most s_max) that is a multiple of the
// granule spacing Gp of every tensor with n > span * S'. With span = 2 these
// are the S no placement rules out (such a tensor holds two boundaries, so S
// must be a multiple of its granule); with span = 1, the S at which every
// tensor that must be cut can be cut anywhere on its granule grid.
int64_t next_multiple(const std::vector<Item>& items, int64_t S, int64_t A, int64_t s_max,
                      int64_t span) {
  int64_t x = S + A;
  while (x < s_max) {
    int64_t step = A;
    int64_t leaves_at = kNone;  // smallest x at which a tensor leaves the set
    for (const Item& it : items) {
      if (it.n / span >= x && it.n != span * x) {  // n > span * x
        step = lcm_capped(step, it.Gp, s_max);
        leaves_at = std::min(leaves_at, round_up(ceil_div(it.n, span), A));
      }
    }
    const int64_t y = step >= s_max ? s_max : round_up(x, step);
    if (y <= leaves_at) return std::min(y, s_max);
    x = leaves_at;
  }
  return s_max;
}

int64_t next_candidate(const std::vector<Item>& items, int64_t S, int64_t A, int64_t s_max) {
  return next_multiple(items, S, A, s_max, 2);
}

// Candidates above lo, ascending: the first few multiples of lcm(A, D) for
// every subset D of the granule spacings of the tensors that must be cut
// (n > lo), taking the few spacings that cover the most elements.
std::vector<int64_t> granule_multiples(const std::vector<Item>& items, int64_t lo, int64_t A,
                                       int64_t s_max) {
  constexpr size_t kSpacings = 6;
  constexpr int kMultiples = 4;
  std::map<int64_t, int64_t> weight;  // Gp -> elements of the cut tensors with it
  for (const Item& it : items) {
    if (it.n > lo) weight[it.Gp] += it.n;
  }
  std::vector<std::pair<int64_t, int64_t>> by_weight;
  for (const auto& [gp, w] : weight) by_weight.push_back({w, gp});
  std::sort(by_weight.rbegin(), by_weight.rend());
  if (by_weight.size() > kSpacings) by_weight.resize(kSpacings);
  std::set<int64_t> steps, out;
  for (uint32_t mask = 1; mask < (1u << by_weight.size()); ++mask) {
    int64_t step = A;
    for (size_t i = 0; i < by_weight.size(); ++i) {
      if (mask & (1u << i)) step = lcm_capped(step, by_weight[i].second, s_max);
    }
    steps.insert(step);
  }
  for (int64_t step : steps) {
    for (int64_t k = 1, c = round_up(lo + 1, step); k <= kMultiples && c < s_max; ++k, c += step) {
      out.insert(c);
    }
  }
  return {out.begin(), out.end()};
}

// Per-tensor quantities the search needs, and the bounds that follow from them.
struct Unit {
  std::vector<Item> items;
  int64_t A = 1;       // alignment in elements
  int64_t total = 0;   // sum of tensor sizes
  int64_t s_max = 0;   // everything in rank 0's slice: always a valid S
  int64_t s_first = 0; // first S on the candidate grid that no bound rules out
  int64_t s_bound = 0; // max(size bound, largest granule a cut tensor needs)
};

Unit describe_unit(const std::vector<TensorSpec>& tensors, int64_t world_size, int64_t A) {
  Unit u;
  u.A = A;
  int64_t s_min = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    Item it{t.numel(), t.granule_elems(), 0, i};
    it.Gp = std::lcm(it.G, A);
    u.items.push_back(it);
    u.total += it.n;
    u.s_max += round_up(it.n, A);
    // A granule never straddles ranks, so a tensor that must be cut needs S >= G.
    s_min = std::max(s_min, round_up(std::min(it.n, it.G), A));
  }
  const int64_t lb = round_up(ceil_div(u.total, world_size), A);
  const int64_t s0 = std::max(lb, s_min);
  u.s_bound = s0;
  // The smallest S >= s0 on the grid (next_candidate returns the first one > its argument).
  u.s_first = s0 >= u.s_max ? u.s_max : next_candidate(u.items, s0 - A, A, u.s_max);
  return u;
}

}  // namespace

namespace {

// Throws std::invalid_argument unless lo <= v <= hi, naming the value and the limits.
void check_range(const std::string& what, int64_t v, int64_t lo, int64_t hi, const char* why) {
  if (v < lo || v > hi) {
    throw std::invalid_argument(what + " must be between " + std::to_string(lo) + " and " +
                                std::to_string(hi) + " (" + why + "), got " + std::to_string(v));
  }
}

// The caller's unit and sizes, checked against the limits (planner.h): after this,
// no product or sum the search forms overflows int64.
void check_inputs(const std::vector<TensorSpec>& tensors, int64_t world_size, int64_t align_bytes) {
  check_unit_specs(tensors);
  check_range("world size", world_size, 1, kMaxWorldSize, "2^24: the planner's limit");
  check_range("align_bytes", align_bytes, 1, kMaxAlignBytes, "2^20: the planner's limit");
  const int64_t eb = tensors.front().elem_bytes;
  const int64_t A = align_elems_for(align_bytes, eb);
  // The largest S any plan may take: every tensor on one rank, each aligned.
  std::optional<int64_t> s_max = 0;
  for (const TensorSpec& t : tensors) {
    if (s_max) s_max = add_checked(*s_max, round_up(t.numel(), A));
  }
  std::optional<int64_t> bytes = s_max ? mul_checked(*s_max, eb) : std::nullopt;
  if (bytes) bytes = mul_checked(*bytes, world_size);
  if (!bytes || *bytes > kMaxGatherBytes) {
    throw std::invalid_argument(
        "the unit is too large for world size " + std::to_string(world_size) + ": world size x " +
        (s_max ? std::to_string(*s_max) : std::string("more than 2^63")) +
        " elements (its tensors, each rounded up to the alignment) x " + std::to_string(eb) +
        " bytes exceeds 2^60 bytes, the planner's limit (a gathered buffer's offsets are int64); "
        "split the unit or plan fewer ranks");
  }
}

// The caller's unit, checked (bad input throws), described.
Unit checked_unit(const std::vector<TensorSpec>& tensors, int64_t world_size, int64_t align_bytes) {
  check_inputs(tensors, world_size, align_bytes);
  return describe_unit(tensors, world_size,
                       align_elems_for(align_bytes, tensors.front().elem_bytes));
}

}  // namespace

int64_t structural_lower_bound(const std::vector<TensorSpec>& tensors, int64_t world_size,
                               int64_t align_bytes) {
  return checked_unit(tensors, world_size, align_bytes).s_first;
}

namespace {

// One buffer for `tensors` (checked by the caller).
Plan plan_one_buffer(const std::vector<TensorSpec>& tensors, int64_t world_size,
                     int64_t align_bytes, const PlannerOptions& options) {
  Plan plan;
  plan.world_size = world_size;
  plan.align_bytes = align_bytes;
  plan.elem_bytes = tensors.front().elem_bytes;
  plan.tensors = tensors;
  plan.offsets.assign(tensors.size(), 0);
  const Unit unit = describe_unit(tensors, world_size, plan.align_elems());
  const std::vector<Item>& items = unit.items;
  const int64_t A = unit.A;

  std::vector<std::vector<size_t>> orders;
  std::vector<size_t> input_order(items.size());
  std::iota(input_order.begin(), input_order.end(), 0);
  const bool exhaustive = static_cast<int>(items.size()) <= options.exhaustive_max_tensors;
  if (!exhaustive) {
    auto by_size = input_order;
    std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
      return items[a].n != items[b].n ? items[a].n > items[b].n : items[a].Gp > items[b].Gp;
    });
    auto by_granule = input_order;
    std::stable_sort(by_granule.begin(), by_granule.end(), [&](size_t a, size_t b) {
      return items[a].Gp != items[b].Gp ? items[a].Gp > items[b].Gp : items[a].n > items[b].n;
    });
    orders = {by_size, by_granule, input_order};
    const int extra = items.size() <= 64 ? options.extra_orders : std::min(8, options.extra_orders);
    if (extra > 0) {
      orders.emplace_back(by_size.rbegin(), by_size.rend());
      orders.emplace_back(by_granule.rbegin(), by_granule.rend());
      std::mt19937_64 rng(items.size());  // deterministic: same unit, same plan
      for (int k = 2; k < extra; ++k) {
        orders.push_back(by_size);
        std::shuffle(orders.back().begin(), orders.back().end(), rng);
      }
    }
  }

  Placer placer(items, world_size, A);
  std::vector<int64_t> offsets(items.size());
  // Tries S; on success keeps its offsets in plan.offsets.
  auto feasible = [&](int64_t s) {
    if (unit.total > world_size * s) return false;
    bool ok = false;
    if (exhaustive) {
      auto order = input_order;
      do {
        ok = placer.place(order, s, false, offsets);
      } while (!ok && std::next_permutation(order.begin(), order.end()));
    } else {
      for (const auto& order : orders) {
        if ((ok = placer.place(order, s, true, offsets))) break;
      }
    }
    if (ok) plan.offsets = offsets;
    return ok;
  };
  // 1. The first grid points, one by one: the optimum is usually among them.
  // 2. If none fits, S values where several cut tensors can be cut anywhere
  //    on their granule grid: multiples of the lcm of the granules of any
  //    subset of them (feasible S cluster there), smallest first.
  // 3. If still none, doubling steps until one fits. Then a bisection between
  //    the last failure and the best S found. Feasibility is not monotone in
  //    S, so the bisection can miss a smaller S; the result is always valid.
  auto first_at_least = [&](int64_t y) {
    return y >= unit.s_max ? unit.s_max : next_candidate(items, y - A, A, unit.s_max);
  };
  const int64_t per_candidate =
      static_cast<int64_t>(items.size()) * (exhaustive ? 1 : static_cast<int64_t>(orders.size()));
  const int64_t linear = std::max<int64_t>(options.min_linear_candidates,
                                           options.linear_placements / per_candidate);
  int64_t S = unit.s_first, lo = -1, hi = -1;
  for (int64_t i = 0; i < linear && hi < 0; ++i) {
    if (feasible(S)) {
      hi = S;
    } else {
      lo = S;
      S = next_candidate(items, S, A, unit.s_max);
    }
  }
  if (hi < 0) {
    for (int64_t c : granule_multiples(items, lo, A, unit.s_max)) {
      if (c == first_at_least(c) && feasible(c)) {
        hi = c;
        break;
      }
    }
    for (int64_t step = A * 64; hi < 0 || lo + step < hi; step *= 2) {
      const int64_t c = first_at_least(lo + step);
      if (hi >= 0 && c >= hi) break;
      if (feasible(c)) {
        hi = c;
        break;
      }
      lo = c;
    }
    while (true) {
      const int64_t first = next_candidate(items, lo, A, unit.s_max);
      if (first >= hi) break;
      int64_t mid = first_at_least(lo + (hi - lo) / 2);
      if (mid >= hi) mid = first;
      if (feasible(mid)) hi = mid; else lo = mid;
    }
  }
  // Every feasible call set hi and wrote its placement, so plan.offsets is hi's.
  plan.shard_elems = hi;
  return plan;
}

// Set partitions of {0..q-1} into at most k blocks, as restricted growth
// strings: block[i] <= 1 + max(block[0..i-1]).
void for_each_partition(int q, int k, const std::function<void(const std::vector<int>&)>& fn) {
  std::vector<int> block(q, 0);
  std::function<void(int, int)> rec = [&](int i, int used) {
    if (i == q) {
      fn(block);
      return;
    }
    for (int b = 0; b < std::min(used + 1, k); ++b) {
      block[i] = b;
      rec(i + 1, std::max(used, b + 1));
    }
  };
  rec(0, 0);
}

// Several buffers: the tensors that must be cut (n above the size bound) in
// classes of one granule spacing, the largest classes first (at most kClasses:
// the rest join the last); every partition of the classes into at most
// max_buffers blocks, the small tensors joining each block in turn; each block
// planned as one buffer (cached by its set). Returns the cheapest, or `single`.
Plan plan_buffers(const std::vector<TensorSpec>& tensors, const Plan& single,
                  const PlannerOptions& options) {
  constexpr int kClasses = 6;
  const int64_t m = single.world_size, A = single.align_elems();
  const int64_t lb = single.lower_bound_shard_elems();
  std::map<int64_t, std::vector<size_t>> by_spacing;
  std::vector<size_t> small;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() > lb) {
      by_spacing[std::lcm(tensors[i].granule_elems(), A)].push_back(i);
    } else {
      small.push_back(i);
    }
  }
  std::vector<std::pair<int64_t, std::vector<size_t>>> classes;  // (elements, tensors)
  for (auto& [gp, idx] : by_spacing) {
    int64_t n = 0;
    for (size_t i : idx) n += tensors[i].numel();
    classes.push_back({n, idx});
  }
  if (classes.empty() || (classes.size() < 2 && small.empty())) return single;
  std::sort(classes.begin(), classes.end(), [](const auto& a, const auto& b) {
    return a.first > b.first;
  });
  while (static_cast<int>(classes.size()) > kClasses) {
    auto last = classes.back();
    classes.pop_back();
    classes.back().second.insert(classes.back().second.end(), last.second.begin(),
                                 last.second.end());
  }
  const int q = static_cast<int>(classes.size());
  const int64_t eb = single.elem_bytes, c = options.collective_cost_bytes;
  // Blocks are planned with a smaller search budget: there are many of them.
  PlannerOptions sub_options = options;
  sub_options.extra_orders = std::min(options.extra_orders, 2);
  sub_options.linear_placements = std::min<int64_t>(options.linear_placements, 20000);
  sub_options.min_linear_candidates = std::min(options.min_linear_candidates, 8);
  sub_options.exhaustive_max_tensors = std::min(options.exhaustive_max_tensors, 4);
  // A block's tensors (the caller's order), its structural bound, its plan; cached.
  auto block_tensors = [&](uint32_t mask, bool with_small) {
    std::vector<size_t> idx;
    for (int k = 0; k < q; ++k) {
      if (mask & (1u << k)) idx.insert(idx.end(), classes[k].second.begin(), classes[k].second.end());
    }
    if (with_small) idx.insert(idx.end(), small.begin(), small.end());
    std::sort(idx.begin(), idx.end());
    return idx;
  };
  auto specs_of = [&](const std::vector<size_t>& idx) {
    std::vector<TensorSpec> sub;
    for (size_t i : idx) sub.push_back(tensors[i]);
    return sub;
  };
  using Key = std::pair<uint32_t, bool>;
  std::map<Key, int64_t> bounds;
  std::map<Key, Plan> plans;
  auto block_bound = [&](Key key) {
    auto it = bounds.find(key);
    if (it != bounds.end()) return it->second;
    // (describe_unit directly: the specs were checked once, by plan_unit)
    const int64_t sb = describe_unit(specs_of(block_tensors(key.first, key.second)), m, A).s_first;
    return bounds.emplace(key, sb).first->second;
  };
  auto block_plan = [&](Key key) -> const Plan& {
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    const auto idx = block_tensors(key.first, key.second);
    Plan p = plan_one_buffer(specs_of(idx), m, single.align_bytes, sub_options);
    p.buffer_of.assign(idx.begin(), idx.end());  // (scratch: the tensors' indices)
    return plans.emplace(key, std::move(p)).first->second;
  };
  auto cost_of = [&](int64_t S, int nb) { return m * S * eb + nb * c; };
  // Every candidate with its bound (the sum of its blocks' structural bounds);
  // planned from the smallest bound up, until the bound is within 0.1 % of the
  // best cost.
  struct Candidate {
    int64_t bound;
    std::vector<Key> blocks;
  };
  std::vector<Candidate> candidates;
  const int kmax = static_cast<int>(options.max_buffers);  // (checked: 1..kMaxBuffers)
  for_each_partition(q, kmax, [&](const std::vector<int>& block) {
    const int blocks = 1 + *std::max_element(block.begin(), block.end());
    std::vector<uint32_t> masks(blocks, 0);
    for (int k = 0; k < q; ++k) masks[block[k]] |= 1u << k;
    // The small tensors join block `with`, or form a buffer of their own (with == blocks).
    for (int with = 0; with < (small.empty() ? 1 : blocks + 1); ++with) {
      Candidate cand;
      for (int b = 0; b < blocks; ++b) cand.blocks.push_back({masks[b], !small.empty() && with == b});
      if (with == blocks && !small.empty()) cand.blocks.push_back({0u, true});
      const int nb = static_cast<int>(cand.blocks.size());
      if (nb < 2 || nb > kmax) continue;
      int64_t S = 0;
      for (const Key& k : cand.blocks) S += block_bound(k);
      cand.bound = cost_of(S, nb);
      candidates.push_back(std::move(cand));
    }
  });
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.bound < b.bound; });
  int64_t best_cost = cost_of(single.shard_elems, 1);
  std::vector<const Plan*> best;
  for (const Candidate& cand : candidates) {
    // Stop once no candidate left could gain a thousandth (plans cost time).
    if (cand.bound + best_cost / 1000 >= best_cost) break;
    std::vector<const Plan*> parts;
    int64_t S = 0;
    for (const Key& k : cand.blocks) {
      parts.push_back(&block_plan(k));
      S += parts.back()->shard_elems;
    }
    const int64_t cost = cost_of(S, static_cast<int>(parts.size()));
    if (cost < best_cost) {
      best_cost = cost;
      best = parts;
    }
  }
  if (best.empty()) return single;
  Plan plan = single;
  plan.shard_elems = 0;
  plan.buffer_shard_elems.clear();
  plan.buffer_of.assign(tensors.size(), 0);
  for (size_t b = 0; b < best.size(); ++b) {
    const Plan& part = *best[b];
    plan.buffer_shard_elems.push_back(part.shard_elems);
    plan.shard_elems += part.shard_elems;
    for (size_t j = 0; j < part.buffer_of.size(); ++j) {
      const size_t i = static_cast<size_t>(part.buffer_of[j]);
      plan.buffer_of[i] = static_cast<int64_t>(b);
      plan.offsets[i] = part.offsets[j];
    }
  }
  return plan;
}

}  // namespace

void check_planner_options(const PlannerOptions& options) {
  check_range("planner: max_buffers", options.max_buffers, 1, kMaxBuffers,
              "the planner's limit; it forms at most 7");
  check_range("planner: collective_cost_bytes", options.collective_cost_bytes, 0,
              kMaxCollectiveCostBytes, "2^50: the planner's limit");
}

int64_t any_buffers_lower_bound(const std::vector<TensorSpec>& tensors, int64_t world_size,
                                int64_t align_bytes) {
  return checked_unit(tensors, world_size, align_bytes).s_bound;
}

Plan plan_unit(const std::vector<TensorSpec>& tensors, int64_t world_size, int64_t align_bytes,
               const PlannerOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  check_planner_options(options);
  check_inputs(tensors, world_size, align_bytes);
  Plan plan = plan_one_buffer(tensors, world_size, align_bytes, options);
  if (options.max_buffers > 1 && plan.shard_elems > plan.lower_bound_shard_elems()) {
    plan = plan_buffers(tensors, plan, options);
  }
  plan.plan_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

}  // namespace rfsdp
