#include "optimizers/common/tiles.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "optimizers/common/matrices.h"
#include "quant/ops.h"

namespace rfsdp {

std::string tile_name(const std::string& param_name, const Tile& t) {
  return "parameter '" + param_name + "' tile of matrix " + std::to_string(t.matrix) + " rows [" +
         std::to_string(t.row0) + ", " + std::to_string(t.row0 + t.rows) + ") columns [" +
         std::to_string(t.col0) + ", " + std::to_string(t.col0 + t.cols) + ")";
}

int64_t tile_granule_rows(const std::vector<int64_t>& shape, int row_dims, int64_t max_dim) {
  if (shape.size() <= 1) return 1;  // not preconditioned: any boundary
  if (shape.size() == 3 && row_dims == 2) {  // E*H rows: tiles of B rows inside each expert
    return shape[1] % max_dim == 0 ? max_dim : shape[1];
  }
  if (shape.size() == 3 && row_dims == 1) return 1;  // a row is a whole expert
  if (row_dims == 1) return max_dim;                 // bands of B rows of dim 0
  throw std::invalid_argument("max_preconditioner_dim tiles: rows of " + std::to_string(row_dims) +
                              " dims of a " + std::to_string(shape.size()) +
                              "-D tensor are not supported (use row_dims 1, or 2 for [E, H, I])");
}

namespace {

// The largest power of two up to max_dim that divides every rank boundary of p
// (in rows of dim 0 of a matrix parameter): a max_preconditioner_dim whose tiles
// those boundaries never cut. 0 if the rows are not those of a 2-D matrix.
int64_t whole_tile_dim(const TensorShard& p, int64_t max_dim) {
  if (p.shape.size() != 2 || p.row_dims != 1) return 0;
  int64_t g = std::gcd(p.row_begin, p.row_end);
  for (const auto& [b, e] : p.rank_rows) g = std::gcd(g, std::gcd(b, e));
  if (g == 0) return 0;
  int64_t d = 1;
  while (d * 2 <= max_dim && g % (d * 2) == 0) d *= 2;
  return d;
}

}  // namespace

std::vector<int64_t> tiling_shape(const char* who, const TensorShard& p, int64_t max_dim) {
  if (p.col_parts == 1) return p.shape;
  const int64_t rows = p.shape[0], width = p.row_len;
  if (width % max_dim != 0) {
    throw std::invalid_argument(
        std::string(who) + ": parameter '" + p.name + "' (" + std::to_string(rows) + " x " +
        std::to_string(p.shape[1]) + ") is held in " + std::to_string(p.col_parts) +
        " column parts of " + std::to_string(width) + " columns (tensor parallelism's Shard(1), "
        "as RowwiseParallel leaves it): its tiles of max_preconditioner_dim=" +
        std::to_string(max_dim) + " columns of the global matrix would be cut by the parts' "
        "column boundaries; use a max_preconditioner_dim that divides " + std::to_string(width) +
        " (the column part width), or give it to rfsdp.optim.AdamW or rfsdp.optim.Muon");
  }
  return {p.col_parts, rows, width};
}

std::vector<Tile> matrix_tiles(const char* who, const TensorShard& p, size_t param,
                               int64_t max_dim, int rank, std::vector<CutTileRow>* cut) {
  std::vector<Tile> out;
  const int64_t e0 = p.row_begin * p.row_len, e1 = p.row_end * p.row_len;
  int64_t left = 0, right = 0;
  auto add_tiles = [&](int64_t k, const MatrixView& m, int64_t r0, int64_t rows, int64_t first,
                       int64_t cut_row) {
    for (int64_t c0 = 0; c0 < m.cols; c0 += max_dim) {
      const int64_t cols = std::min(max_dim, m.cols - c0);
      out.push_back({param, k, r0, rows, c0, cols, first + c0, m.cols, left, right, cut_row});
      left += packed_size(rows);
      right += packed_size(cols);
    }
  };
  const auto mats = matrices_of(tiling_shape(who, p, max_dim));
  for (size_t k = 0; k < mats.size(); ++k) {
    const MatrixView& m = mats[k];
    if (m.cols == 0) continue;
    for (int64_t r0 = 0; r0 < m.rows; r0 += max_dim) {
      const int64_t rows = std::min(max_dim, m.rows - r0);
      const int64_t lo = m.offset + r0 * m.cols, hi = lo + rows * m.cols;
      if (cut && p.knows_every_rank()) {  // a row of tiles that several ranks hold: cut
        int holders = 0, owner = -1;
        for (size_t r = 0; r < p.rank_rows.size(); ++r) {
          const int64_t b = std::max(lo, p.rank_rows[r].first * p.row_len);
          const int64_t e = std::min(hi, p.rank_rows[r].second * p.row_len);
          if (e > b) ++holders;
          if (e > b && b == lo) owner = static_cast<int>(r);
        }
        if (holders > 1) {
          cut->push_back({param, static_cast<int64_t>(k), r0, rows, m.cols, lo, hi, owner});
          if (owner == rank) {
            add_tiles(static_cast<int64_t>(k), m, r0, rows, 0, static_cast<int64_t>(cut->size()) - 1);
          }
          continue;
        }
      }
      if (hi <= e0 || lo >= e1) continue;  // another rank's
      if (lo < e0 || hi > e1) {
        const int64_t d = whole_tile_dim(p, max_dim);
        std::string fixes =
            "keep every tile on one rank: with rfsdp.fully_shard, plan the unit with "
            "rfsdp.policy.shampoo(max_preconditioner_dim=" + std::to_string(max_dim) + ")";
        if (d > 1) {
          fixes += "; with torch's fully_shard (FSDP2's chunk rows), or these rows, "
                   "max_preconditioner_dim=" + std::to_string(d) + " divides every rank's "
                   "first row";
        }
        fixes += "; or describe the shard with every rank's rows (as FSDP2's DTensors and "
                 "rfsdp's plans do) so the ranks share the cut tiles";
        throw std::invalid_argument(
            std::string(who) + ": parameter '" + p.name + "': this shard holds elements [" +
            std::to_string(e0) + ", " + std::to_string(e1) + "), which cut the tile rows [" +
            std::to_string(r0) + ", " + std::to_string(r0 + rows) + ") of matrix " +
            std::to_string(k) + " (tiles of up to max_preconditioner_dim=" +
            std::to_string(max_dim) + " rows); " + fixes);
      }
      add_tiles(static_cast<int64_t>(k), m, r0, rows, lo - e0, -1);
    }
  }
  return out;
}

namespace {

// On a GPU: the flat positions of an n x n matrix's upper triangle, row by row
// (the packed order), and of their mirror images; made once per size and device.
struct TriangleIndex {
  at::Tensor upper, lower;  // int64 [n (n + 1) / 2]
};
const TriangleIndex& triangle_index(int64_t n, const at::Device& device) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int, int>, TriangleIndex> cache;
  std::lock_guard<std::mutex> lock(mu);
  TriangleIndex& t = cache[{n, static_cast<int>(device.type()), static_cast<int>(device.index())}];
  if (!t.upper.defined()) {
    const at::Tensor ij = at::triu_indices(n, n, 0, at::TensorOptions(at::kLong).device(device));
    t.upper = ij[0] * n + ij[1];
    t.lower = ij[1] * n + ij[0];
  }
  return t;
}

}  // namespace

// Row i of the upper triangle, columns [i, n), follows rows 0..i-1: plain copies
// at memory speed on the CPU (an index_select/index_copy pair cost 30% of a step);
// elsewhere (and on the device-generic path, quant/ops/device_path.h) index ops.
at::Tensor pack_symmetric(const at::Tensor& full) {
  const at::Tensor f = full.to(at::kFloat).contiguous();
  const int64_t n = f.size(0);
  if (!f.is_cpu() || quant::device_generic_path()) {  // one gather of the upper triangle, row by row
    return f.view(-1).index_select(0, triangle_index(n, f.device()).upper);
  }
  at::Tensor out = at::empty({packed_size(n)}, at::kFloat);
  const float* src = f.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(src + i * n + i, src + (i + 1) * n, dst);
    dst += n - i;
  }
  return out;
}

at::Tensor unpack_symmetric(const at::Tensor& flat, int64_t offset, int64_t n) {
  const at::Tensor packed = flat.narrow(0, offset, packed_size(n)).to(at::kFloat).contiguous();
  if (!packed.is_cpu() || quant::device_generic_path()) {  // two scatters (the mirror, then the upper triangle)
    const TriangleIndex& ix = triangle_index(n, packed.device());
    at::Tensor full = at::empty({n * n}, packed.options());
    full.index_put_({ix.lower}, packed);
    full.index_put_({ix.upper}, packed);
    return full.view({n, n});
  }
  at::Tensor full = at::empty({n, n}, at::kFloat);
  const float* src = packed.data_ptr<float>();
  float* dst = full.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(src, src + (n - i), dst + i * n + i);
    src += n - i;
  }
  for (int64_t i = 1; i < n; ++i) {  // the lower triangle mirrors the upper
    for (int64_t j = 0; j < i; ++j) dst[i * n + j] = dst[j * n + i];
  }
  return full;
}

}  // namespace rfsdp
