// rfsdp._C: optimizers/ (the C++ optimizers over this rank's shards, and the tiles).
#include "python/bindings/bindings.h"

#include "optimizers/adamw/adamw.h"
#include "optimizers/common/tiles.h"
#include "optimizers/muon/muon.h"
#include "optimizers/shampoo/shampoo.h"
#include "optimizers/soap/soap.h"

namespace rfsdp_bind {

namespace {

// basis_dtype "int8" / "int4": its bits; anything else 0.
int lowbit_bits(const std::string& basis_dtype) {
  return basis_dtype == "int8" ? 8 : basis_dtype == "int4" ? 4 : 0;
}

// An optimizer's parameter from Python: its shard descriptor and this rank's tensor.
using ShardOf = std::pair<rfsdp::TensorShard, at::Tensor>;

std::vector<rfsdp::ParamShard> shards_of(const std::vector<ShardOf>& given) {
  std::vector<rfsdp::ParamShard> out;
  for (const auto& [shard, param] : given) out.emplace_back(shard, param);
  return out;
}

py::dict named(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  py::dict d;
  for (const auto& [name, t] : tensors) d[py::str(name)] = t;
  return d;
}

}  // namespace

void bind_optimizers(py::module_& m) {
  // The optimizers: the C++ classes over this rank's shards. Python's
  // rfsdp.optim keeps param groups, schedulers and state_dict; it sends the
  // gradients once per step (set_grads) and a group's options when they change.
  py::class_<rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::ShardedOptimizer>>(m, "ShardedOptimizer")
      .def("set_grads", [](rfsdp::ShardedOptimizer& o, const std::vector<std::optional<at::Tensor>>& gs) {
             std::vector<at::Tensor> grads;
             for (const auto& g : gs) grads.push_back(g ? *g : at::Tensor());
             o.set_grads(grads);
           })
      .def("set_groups", &rfsdp::ShardedOptimizer::set_groups)
      .def("set_param", &rfsdp::ShardedOptimizer::set_param)
      .def("set_rounding", [](rfsdp::ShardedOptimizer& o, const std::string& r, uint64_t seed) {
             o.set_rounding(rfsdp::parse_rounding(r), seed);
           })
      .def("step", &rfsdp::ShardedOptimizer::step, py::call_guard<py::gil_scoped_release>())  // collective
      .def("step_refused", &rfsdp::ShardedOptimizer::step_refused, py::arg("message"),
           py::arg("invalid_argument"), py::call_guard<py::gil_scoped_release>())  // collective
      .def("name", &rfsdp::ShardedOptimizer::name)
      .def("param_name", [](const rfsdp::ShardedOptimizer& o, size_t i) { return o.params().at(i).name; })
      .def("step_count", &rfsdp::ShardedOptimizer::step_count)
      .def("step_counts", &rfsdp::ShardedOptimizer::step_counts)
      .def("set_step_count", &rfsdp::ShardedOptimizer::set_step_count)
      .def("state_has_step", &rfsdp::ShardedOptimizer::state_has_step)
      .def("state", [](const rfsdp::ShardedOptimizer& o, size_t i) { return named(o.state(i)); })
      // {name: ("rows", 0, 0, 0) or ("sequence", total, offset, shared)}
      .def("state_layout", [](const rfsdp::ShardedOptimizer& o, size_t i) {
             py::dict d;
             for (const auto& l : o.state_layout(i)) {
               const bool rows = l.kind == rfsdp::StateLayout::Kind::kRows;
               d[py::str(l.name)] = py::make_tuple(rows ? "rows" : "sequence", l.total, l.offset,
                                                   l.shared);
             }
             return d;
           })
      .def("state_bytes", &rfsdp::ShardedOptimizer::state_bytes)
      .def("fused_launches", &rfsdp::ShardedOptimizer::fused_launches);

  py::class_<rfsdp::AdamW, rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::AdamW>>(m, "AdamW")
      .def(py::init([](const std::vector<ShardOf>& params, std::shared_ptr<rfsdp::Comm> comm,
                       bool check_finite, bool fused_on_cpu) {
             rfsdp::AdamWOptions o;
             o.check_finite = check_finite;
             o.fused_on_cpu = fused_on_cpu;
             return std::make_shared<rfsdp::AdamW>(shards_of(params), o, std::move(comm));
           }),
           py::arg("params"), py::arg("comm"), py::arg("check_finite") = true,
           py::arg("fused_on_cpu") = false)
      .def("set_group_options", [](rfsdp::AdamW& o, size_t g, double lr, double b1, double b2,
                                   double eps, double wd) {
             rfsdp::AdamWOptions x = o.group_options(g);
             x.lr = lr, x.beta1 = b1, x.beta2 = b2, x.eps = eps, x.weight_decay = wd;
             o.set_group_options(g, x);
           });
  py::class_<rfsdp::AdamW8bit, rfsdp::AdamW, std::shared_ptr<rfsdp::AdamW8bit>>(m, "AdamW8bit")
      .def(py::init([](const std::vector<ShardOf>& params, const py::object& block,
                       int64_t min_8bit_size, std::shared_ptr<rfsdp::Comm> comm,
                       bool check_finite) {
             rfsdp::AdamWOptions o;
             o.check_finite = check_finite;
             return std::make_shared<rfsdp::AdamW8bit>(shards_of(params), o, block_shape(block),
                                                       min_8bit_size, std::move(comm));
           }),
           py::arg("params"), py::arg("block"), py::arg("min_8bit_size"), py::arg("comm"),
           py::arg("check_finite") = true)
      // (global blocks, global index of the first absmax entry, leading entries of blocks
      // that start on an earlier rank)
      .def("block_span", [](const rfsdp::AdamW8bit& o, size_t i) {
             const auto s = o.block_span(i);
             return py::make_tuple(s.global_blocks, s.first, s.shared_head);
           })
      .def("shared_blocks", &rfsdp::AdamW8bit::shared_blocks);

  // Muon over one process group: roots chosen at construction (collective), then steps.
  py::class_<rfsdp::Muon, rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::Muon>>(m, "Muon")
      .def(py::init([](const std::vector<ShardOf>& params, const std::vector<int>& ns_steps,
                       const std::string& ns_dtype, std::shared_ptr<rfsdp::Comm> comm,
                       bool check_finite, const std::string& momentum_dtype,
                       int64_t momentum_block, const std::string& momentum_map,
                       const std::vector<bool>& use_muon) {
             rfsdp::MuonOptions o;
             o.ns_dtype = dtype_of(ns_dtype);
             o.check_finite = check_finite;
             o.momentum_dtype = momentum_dtype == "int8" ? at::kByte : dtype_of(momentum_dtype);
             o.momentum_block = momentum_block;
             o.momentum_map = momentum_map;
             auto shards = shards_of(params);
             py::gil_scoped_release release;  // collective
             return std::make_shared<rfsdp::Muon>(std::move(comm), std::move(shards), o, ns_steps,
                                                  use_muon);
           }),
           py::arg("params"), py::arg("ns_steps"), py::arg("ns_dtype"), py::arg("comm"),
           py::arg("check_finite") = true, py::arg("momentum_dtype") = "float32",
           py::arg("momentum_block") = 256, py::arg("momentum_map") = "dynamic",
           py::arg("use_muon") = std::vector<bool>{})
      .def("set_group_options", [](rfsdp::Muon& o, size_t g, double lr, double momentum, double wd,
                                   bool nesterov, const std::string& adjust_lr, double b1, double b2,
                                   double eps) {
             o.set_group_options(g, {lr, momentum, wd, nesterov,
                                     rfsdp::parse_muon_adjust_lr(adjust_lr), b1, b2, eps});
           },
           py::arg("group"), py::arg("lr"), py::arg("momentum"), py::arg("weight_decay"),
           py::arg("nesterov"), py::arg("adjust_lr"), py::arg("beta1") = 0.9, py::arg("beta2") = 0.95,
           py::arg("eps") = 1e-10)
      .def("matrices", [](const rfsdp::Muon& o) {
             py::list out;
             for (const auto& x : o.layout().matrices()) {
               out.append(py::dict(py::arg("param") = o.muon_params().at(x.param), py::arg("offset") = x.offset,
                                   py::arg("rows") = x.rows, py::arg("cols") = x.cols,
                                   py::arg("root") = x.root, py::arg("flops") = x.flops));
             }
             return out;
           })
      .def("flop_imbalance", [](const rfsdp::Muon& o) { return o.layout().flop_imbalance(); })
      .def("gather_send_elems", [](const rfsdp::Muon& o) { return o.layout().gather_send_elems(); });

  // Shampoo: each rank's tiles are its own (no communication but the NaN flag).
  py::class_<rfsdp::Shampoo, rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::Shampoo>>(m, "Shampoo")
      .def(py::init([](const std::vector<ShardOf>& params, const std::vector<bool>& precondition,
                       int64_t max_dim, int frequency, int start, bool bias_correction,
                       const std::string& factor_dtype, std::shared_ptr<rfsdp::Comm> comm,
                       const std::string& rank_deficient, double rank_rtol,
                       const std::string& basis_dtype, int64_t basis_block,
                       const std::string& basis_map, int bjorck_iterations) {
             rfsdp::ShampooConfig c;
             c.max_preconditioner_dim = max_dim;
             c.precondition_frequency = frequency;
             c.start_preconditioning_step = start;
             c.use_bias_correction = bias_correction;
             c.factor_dtype = dtype_of(factor_dtype);
             c.rank_deficient = rfsdp::parse_rank_deficient(rank_deficient);
             c.rank_rtol = rank_rtol;
             c.basis_bits = lowbit_bits(basis_dtype);
             if (!c.basis_bits && !basis_dtype.empty()) {
               throw std::invalid_argument("Shampoo: basis_dtype must be \"int8\", \"int4\" or none");
             }
             c.basis_block = basis_block;
             c.basis_map = basis_map;
             c.bjorck_iterations = bjorck_iterations;
             return std::make_shared<rfsdp::Shampoo>(shards_of(params), rfsdp::ShampooOptions{}, c,
                                                     std::move(comm), precondition);
           }),
           py::arg("params"), py::arg("precondition"), py::arg("max_preconditioner_dim"),
           py::arg("precondition_frequency"), py::arg("start_preconditioning_step"),
           py::arg("use_bias_correction"), py::arg("factor_dtype"), py::arg("comm"),
           py::arg("rank_deficient") = "shift", py::arg("rank_rtol") = -1.0,
           py::arg("basis_dtype") = "", py::arg("basis_block") = 64,
           py::arg("basis_map") = "linear_square", py::arg("bjorck_iterations") = 1)
      .def("set_group_options", [](rfsdp::Shampoo& o, size_t g, double lr, double b1, double b2,
                                   double eps, double gb2, double geps, double wd) {
             o.set_group_options(g, {lr, b1, b2, eps, gb2, geps, wd});
           })
      .def("num_tiles", [](const rfsdp::Shampoo& o) { return o.tiles().size(); })
      .def("shared_tile_rows", [](const rfsdp::Shampoo& o) { return o.cut_rows().size(); })
      .def("factor_bytes", &rfsdp::Shampoo::factor_bytes)
      .def("root_seconds", &rfsdp::Shampoo::root_seconds)
      .def("fp64_retries", &rfsdp::Shampoo::fp64_retries);
  py::class_<rfsdp::SOAP, rfsdp::ShardedOptimizer, std::shared_ptr<rfsdp::SOAP>>(m, "SOAP")
      .def(py::init([](const std::vector<ShardOf>& params, const std::vector<bool>& precondition,
                       int64_t max_dim, int frequency, bool correct_bias,
                       const std::string& factor_dtype, const std::string& basis_dtype,
                       std::shared_ptr<rfsdp::Comm> comm, const std::string& state_dtype,
                       int64_t basis_block, const std::string& basis_map, int bjorck_iterations) {
             rfsdp::SOAPConfig c;
             c.max_preconditioner_dim = max_dim;
             c.precondition_frequency = frequency;
             c.correct_bias = correct_bias;
             c.factor_dtype = dtype_of(factor_dtype);
             c.state_dtype = state_dtype == "int8" ? at::kByte : dtype_of(state_dtype);
             c.basis_bits = lowbit_bits(basis_dtype);
             if (!c.basis_bits) c.basis_dtype = dtype_of(basis_dtype);
             c.basis_block = basis_block;
             c.basis_map = basis_map;
             c.bjorck_iterations = bjorck_iterations;
             return std::make_shared<rfsdp::SOAP>(shards_of(params), rfsdp::SOAPOptions{}, c,
                                                  std::move(comm), precondition);
           }),
           py::arg("params"), py::arg("precondition"), py::arg("max_preconditioner_dim"),
           py::arg("precondition_frequency"), py::arg("correct_bias"), py::arg("factor_dtype"),
           py::arg("basis_dtype"), py::arg("comm"), py::arg("state_dtype") = "float32",
           py::arg("basis_block") = 64, py::arg("basis_map") = "linear_square",
           py::arg("bjorck_iterations") = 1)
      .def("set_group_options", [](rfsdp::SOAP& o, size_t g, double lr, double b1, double b2,
                                   double shampoo_beta, double eps, double wd) {
             o.set_group_options(g, {lr, b1, b2, shampoo_beta, eps, wd});
           })
      .def("num_tiles", [](const rfsdp::SOAP& o) { return o.tiles().size(); })
      .def("shared_tile_rows", [](const rfsdp::SOAP& o) { return o.cut_rows().size(); })
      .def("fp64_retries", &rfsdp::SOAP::fp64_retries);
  m.def("shampoo_granule_rows", &rfsdp::tile_granule_rows, py::arg("shape"),
        py::arg("row_dims"), py::arg("max_preconditioner_dim"));
  m.def("shampoo_tile_list",
        [](const std::vector<int64_t>& shape, int64_t max_dim) {
          std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
          for (const auto& t : rfsdp::matrix_tiles("Shampoo", rfsdp::TensorShard::whole("tensor", shape),
                                                   0, max_dim)) {
            out.emplace_back(t.local_offset, t.rows, t.cols, t.stride);
          }
          return out;
        },
        py::arg("shape"), py::arg("max_preconditioner_dim"),
        "A tensor's Shampoo / SOAP tiles in tile order: (first element, rows, columns, row stride)");
  m.def("shampoo_unpack", &rfsdp::unpack_symmetric, py::arg("flat"), py::arg("offset"), py::arg("n"),
        "The n x n symmetric matrix packed (upper triangle, row by row) at offset of flat, fp32");
  m.def("shampoo_pack", &rfsdp::pack_symmetric, py::arg("full"),
        "A symmetric matrix's upper triangle, row by row (float32)");

  m.def("newton_schulz",
        [](const at::Tensor& g, int steps, const std::string& dtype) {
          return rfsdp::newton_schulz(g, steps, dtype_of(dtype));
        },
        py::arg("g"), py::arg("steps") = 5, py::arg("dtype") = "float32",
        "Muon's quintic Newton–Schulz of a matrix or a batch of matrices (float32 result)",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace rfsdp_bind
