#include "core/comm/agree.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace rfsdp {

namespace {

// A [world] int64 table on the control device where each rank fills its own
// entry; summed over the ranks.
std::vector<int64_t> all_ranks_value(Comm& comm, int64_t mine) {
  at::Tensor t = at::zeros({comm.size()}, at::kLong);
  t[comm.rank()] = mine;
  if (comm.size() > 1) {
    at::Tensor shared = t.to(comm.control_device());  // NCCL takes no CPU tensors
    comm.all_reduce(shared, ReduceOp::Sum).wait();
    t = shared.cpu();
  }
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + comm.size());
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// 64-bit FNV-1a of the lines (each terminated, so ["ab"] and ["a", "b"] differ).
uint64_t hash_lines(const std::vector<std::string>& lines) {
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](unsigned char c) { h = (h ^ c) * 1099511628211ULL; };
  for (const auto& l : lines) {
    for (char c : l) mix(static_cast<unsigned char>(c));
    mix('\n');
  }
  return h;
}

}  // namespace

std::vector<std::string> all_gather_strings(Comm& comm, const std::string& mine) {
  if (comm.size() == 1) return {mine};
  const std::vector<int64_t> lengths = all_ranks_value(comm, static_cast<int64_t>(mine.size()));
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  at::Tensor bytes = at::zeros({longest * comm.size()}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>() + comm.rank() * longest, mine.data(), mine.size());
  at::Tensor shared = bytes.to(comm.control_device());
  comm.all_gather_flat(shared).wait();
  bytes = shared.cpu();
  std::vector<std::string> out;
  for (int r = 0; r < comm.size(); ++r) {
    const char* p = reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>() + r * longest);
    out.emplace_back(p, static_cast<size_t>(lengths[r]));
  }
  return out;
}

void agree_lines(Comm& comm, const std::vector<std::string>& lines, const std::string& what) {
  if (comm.size() == 1) return;
  // The hash's top bits dropped: one non-zero entry per rank sums without overflow.
  const int64_t h = static_cast<int64_t>(hash_lines(lines) >> 2);
  const std::vector<int64_t> hashes = all_ranks_value(comm, h);
  if (std::all_of(hashes.begin(), hashes.end(), [&](int64_t x) { return x == hashes[0]; })) return;
  std::string joined;
  for (const auto& l : lines) joined += l + "\n";
  std::vector<std::vector<std::string>> all;
  for (const auto& s : all_gather_strings(comm, joined)) all.push_back(split_lines(s));
  // The first line where some rank differs from rank 0, and the ranks that differ there.
  const size_t longest = std::max_element(all.begin(), all.end(), [](const auto& a, const auto& b) {
                           return a.size() < b.size();
                         })->size();
  for (size_t k = 0; k < longest; ++k) {
    auto line = [&](int r) { return k < all[r].size() ? all[r][k] : std::string("(nothing)"); };
    std::vector<int> differ;
    for (int r = 1; r < comm.size(); ++r) {
      if (line(r) != line(0)) differ.push_back(r);
    }
    if (differ.empty()) continue;
    std::string ranks;
    for (int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw std::invalid_argument(
        what + " differs between ranks: rank 0 has '" + line(0) + "', rank " +
        std::to_string(differ[0]) + " has '" + line(differ[0]) + "' (ranks that differ from rank 0: " +
        ranks + "); every rank must build the same model and call it in the same order");
  }
  // Equal lines under different hashes cannot happen; if it did, say so rather than pass.
  throw std::runtime_error(what + ": the ranks' hashes differ but their lines are equal");
}

}  // namespace rfsdp
