// The rfsdp._C extension: the C++ library's pieces, bound for Python (torch
// tensors in and out). Glue only: every behaviour lives in the library.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "rfsdp_version.h"  // generated (cmake/rfsdp_version.h.in)
#include "core/comm/agree.h"
#include "core/comm/comm.h"
#include "core/ragged/plan_json.h"
#include "fsdp/fsdp_unit.h"
#include "fsdp/grad_clip.h"
#include "optimizers/adamw/adamw.h"
#include "optimizers/common/step_gate.h"
#include "optimizers/muon/muon.h"
#include "optimizers/shampoo/shampoo.h"
#include "optimizers/soap/soap.h"
#include "quant/blockwise/cpu_kernels.h"
#include "core/ragged/planner.h"
#include "quant/blockwise/blockwise.h"
#include "quant/blockwise/code_maps.h"
#include "quant/blockwise/cuda_ops.h"
#include "quant/blockwise/lowbit.h"

namespace py = pybind11;

namespace {

rfsdp::quant::BlockShape block_shape(const py::object& block) {
  if (py::isinstance<py::int_>(block)) return rfsdp::quant::BlockShape::blocks(block.cast<int64_t>());
  auto t = block.cast<std::pair<int64_t, int64_t>>();
  return rfsdp::quant::BlockShape::tiles(t.first, t.second);
}

// basis_dtype "int8" / "int4": its bits; anything else 0.
int lowbit_bits(const std::string& basis_dtype) {
  return basis_dtype == "int8" ? 8 : basis_dtype == "int4" ? 4 : 0;
}

// The planner's options from Python (plan_unit checks them).
rfsdp::PlannerOptions planner_options(int max_buffers, int64_t collective_cost_bytes) {
  rfsdp::PlannerOptions o;
  o.max_buffers = max_buffers;
  o.collective_cost_bytes = collective_cost_bytes;
  return o;
}

// Plans from Python's spec list: [(name, shape, granule_rows (0 = whole), row_dims, dtype_bytes)].
rfsdp::Plan plan_specs(const std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, int,
                                                    int64_t>>& specs,
                       int64_t world_size, int64_t align_bytes, int max_buffers,
                       int64_t collective_cost_bytes) {
  std::vector<rfsdp::TensorSpec> ts;
  for (const auto& [name, shape, g, row_dims, bytes] : specs) {
    rfsdp::TensorSpec t;
    t.name = name;
    t.shape = shape;
    t.granule_rows = g == 0 ? rfsdp::kWholeTensor : g;
    t.row_dims = row_dims;
    t.elem_bytes = bytes;
    ts.push_back(t);
  }
  return rfsdp::plan_unit(ts, world_size, align_bytes,
                          planner_options(max_buffers, collective_cost_bytes));
}

// torch dtype names ("float32", ...) as Python's str(dtype) spells them, less "torch.".
at::ScalarType dtype_of(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float64") return at::kDouble;
  throw std::invalid_argument("unsupported dtype '" + name +
                              "': use float32, bfloat16, float16 or float64");
}

// The raw kernels below trust their pointers: check sizes and dtypes here.
void expect(const at::Tensor& t, at::ScalarType dt, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.device().is_cpu() && t.numel() == n,
              what, ": expected a contiguous CPU tensor of ", n, " ", c10::toString(dt),
              " elements, got ", t.numel(), " ", c10::toString(t.scalar_type()));
}

const rfsdp::quant::cpu::CodeLut& lut_of(const at::Tensor& code, bool keep_nonzero = false) {
  // code_lut caches per distinct code; the shared_ptr it returns stays in the cache.
  return *rfsdp::quant::code_lut(code, keep_nonzero);
}

// A Comm over a torch.distributed group, with a timeout in seconds as Python
// gives it. Destroying it may destroy the group, whose Gloo worker threads can
// need the GIL to free Python-owned tensors while it joins them: the GIL is
// released for that.
std::shared_ptr<rfsdp::Comm> make_comm(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                       double timeout_seconds) {
  return std::shared_ptr<rfsdp::Comm>(
      new rfsdp::Comm(pg, std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000))),
      [](rfsdp::Comm* c) {
        if (PyGILState_Check()) {
          py::gil_scoped_release release;
          delete c;
        } else {
          delete c;
        }
      });
}

py::dict stats_dict(const rfsdp::CommStats& s) {
  return py::dict(py::arg("collectives") = s.collectives, py::arg("fallbacks") = s.fallbacks,
                  py::arg("gathers_native") = s.gathers_native,
                  py::arg("gathers_per_rank") = s.gathers_per_rank,
                  py::arg("reduce_scatters_native") = s.reduce_scatters_native,
                  py::arg("reduce_scatters_per_rank") = s.reduce_scatters_per_rank,
                  py::arg("bytes_sent") = s.bytes_sent, py::arg("bytes_copied") = s.bytes_copied);
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

PYBIND11_MODULE(_C, m) {
  m.doc() = "RaggedFSDP C++ core";
  m.attr("__version__") = RFSDP_VERSION;

  py::class_<rfsdp::CommHandle>(m, "CommHandle")
      .def("wait", &rfsdp::CommHandle::wait, py::call_guard<py::gil_scoped_release>())
      .def("waited", &rfsdp::CommHandle::waited);

  py::class_<rfsdp::Comm, std::shared_ptr<rfsdp::Comm>>(m, "Comm")
      .def(py::init(&make_comm), py::arg("process_group"), py::arg("timeout_seconds") = 300.0)
      .def("rank", &rfsdp::Comm::rank)
      .def("size", &rfsdp::Comm::size)
      .def("close", &rfsdp::Comm::close, py::call_guard<py::gil_scoped_release>())
      .def("closed", &rfsdp::Comm::closed)
      .def("stats", [](const rfsdp::Comm& c) { return stats_dict(c.stats()); })
      .def("reset_stats", &rfsdp::Comm::reset_stats);

  // One rank's piece of a tensor (core/ragged/tensor_shard.h): what fully_shard
  // makes per parameter and every optimizer, clipping and checkpoint reads;
  // rfsdp.ShardInfo is a view of it.
  py::class_<rfsdp::TensorShard>(m, "TensorShard")
      .def(py::init(&rfsdp::TensorShard::rows_of), py::arg("name"), py::arg("shape"),
           py::arg("row_dims"), py::arg("row_begin"), py::arg("row_end"),
           py::arg("rank_rows") = std::vector<std::pair<int64_t, int64_t>>())
      .def_static("whole", &rfsdp::TensorShard::whole, py::arg("name"), py::arg("shape"),
                  py::arg("row_dims") = 1)
      .def_readonly("name", &rfsdp::TensorShard::name)
      .def_property_readonly("shape", [](const rfsdp::TensorShard& t) {
             return py::tuple(py::cast(t.shape));
           })
      .def_readonly("row_dims", &rfsdp::TensorShard::row_dims)
      .def_readonly("full_rows", &rfsdp::TensorShard::full_rows)
      .def_readonly("row_len", &rfsdp::TensorShard::row_len)
      .def_readonly("row_begin", &rfsdp::TensorShard::row_begin)
      .def_readonly("row_end", &rfsdp::TensorShard::row_end)
      .def_readonly("rank_rows", &rfsdp::TensorShard::rank_rows)
      .def(py::pickle(
          [](const rfsdp::TensorShard& t) {
            return py::make_tuple(t.name, t.shape, t.row_dims, t.row_begin, t.row_end, t.rank_rows);
          },
          [](const py::tuple& s) {
            return rfsdp::TensorShard::rows_of(
                s[0].cast<std::string>(), s[1].cast<std::vector<int64_t>>(), s[2].cast<int>(),
                s[3].cast<int64_t>(), s[4].cast<int64_t>(),
                s[5].cast<std::vector<std::pair<int64_t, int64_t>>>());
          }));

  py::class_<rfsdp::FSDPUnit, std::shared_ptr<rfsdp::FSDPUnit>>(m, "FSDPUnit")
      .def(py::init([](std::shared_ptr<rfsdp::Comm> comm, const rfsdp::Plan& plan,
                       const std::string& param_dtype, const std::string& reduce_dtype,
                       std::shared_ptr<rfsdp::Comm> replicate, const std::string& device,
                       bool agree) {
             return std::make_shared<rfsdp::FSDPUnit>(
                 std::move(comm), std::move(replicate), plan,
                 rfsdp::MixedPrecision{dtype_of(param_dtype), dtype_of(reduce_dtype)},
                 at::Device(device), agree);
           }),
           py::arg("comm"), py::arg("plan"), py::arg("param_dtype"), py::arg("reduce_dtype"),
           py::arg("replicate") = nullptr, py::arg("device") = "cpu", py::arg("agree") = true,
           // HSDP checks the replicas with a collective: Gloo's workers may need the GIL.
           py::call_guard<py::gil_scoped_release>())
      .def("device", [](const rfsdp::FSDPUnit& u) { return u.device().str(); })
      .def("shard", &rfsdp::FSDPUnit::shard)
      // Calls that enqueue collectives release the GIL: a Gloo worker thread may need it
      // to free a Python-owned tensor of an earlier collective while holding the work
      // queue's lock, which enqueueing waits for (a deadlock otherwise).
      .def("unshard", &rfsdp::FSDPUnit::unshard, py::call_guard<py::gil_scoped_release>())
      .def("reshard", &rfsdp::FSDPUnit::reshard)
      .def("unsharded", &rfsdp::FSDPUnit::unsharded)
      .def("gathered_bytes", &rfsdp::FSDPUnit::gathered_bytes)
      .def("bytes_cast", &rfsdp::FSDPUnit::bytes_cast)
      .def("prepare_grads", &rfsdp::FSDPUnit::prepare_grads, py::arg("keep") = false)
      .def("reduce_grads", [](rfsdp::FSDPUnit& u, bool avg) {
             return u.reduce_grads(avg ? rfsdp::ReduceOp::Avg : rfsdp::ReduceOp::Sum);
           }, py::arg("average") = true, py::call_guard<py::gil_scoped_release>())
      .def("zero_grad", &rfsdp::FSDPUnit::zero_grad)
      .def("full_param", &rfsdp::FSDPUnit::full_param)
      .def("full_grad", &rfsdp::FSDPUnit::full_grad)
      .def("local_param", &rfsdp::FSDPUnit::local_param)
      .def("local_grad", &rfsdp::FSDPUnit::local_grad)
      .def("tensor_shard", &rfsdp::FSDPUnit::tensor_shard)
      .def("stats", [](rfsdp::FSDPUnit& u) { return stats_dict(u.comm().stats()); });

  m.def("clip_grad_norm", [](const std::vector<std::shared_ptr<rfsdp::FSDPUnit>>& units,
                             double max_norm, bool error_if_nonfinite) {
          std::vector<rfsdp::FSDPUnit*> raw;
          for (const auto& u : units) raw.push_back(u.get());
          py::gil_scoped_release release;
          return rfsdp::clip_grad_norm(raw, max_norm, error_if_nonfinite);
        });

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
  m.def("lowbit_quantize",
        [](const at::Tensor& x, const std::string& map, int bits, int64_t block) {
          const int64_t n = x.numel();
          at::Tensor codes = at::empty({rfsdp::quant::lowbit_code_bytes(n, bits)}, at::kByte);
          at::Tensor absmax = at::empty({rfsdp::quant::lowbit_blocks(n, block)}, at::kFloat);
          rfsdp::quant::lowbit_quantize(x.reshape(-1).to(at::kFloat), rfsdp::quant::lowbit_map(map, bits),
                                        bits, block, codes, absmax);
          return py::make_tuple(codes, absmax);
        },
        py::arg("x"), py::arg("map"), py::arg("bits"), py::arg("block"));
  m.def("lowbit_dequantize",
        [](const at::Tensor& codes, const at::Tensor& absmax, const std::string& map, int bits,
           int64_t block, int64_t n) {
          return rfsdp::quant::lowbit_dequantize(codes, absmax, rfsdp::quant::lowbit_map(map, bits), bits,
                                                 block, n);
        },
        py::arg("codes"), py::arg("absmax"), py::arg("map"), py::arg("bits"), py::arg("block"),
        py::arg("n"));
  m.def("bjorck", &rfsdp::quant::bjorck, py::arg("v"), py::arg("iterations"));
  m.def("shampoo_unpack", &rfsdp::unpack_symmetric, py::arg("flat"), py::arg("offset"), py::arg("n"),
        "The n x n symmetric matrix packed (upper triangle, row by row) at offset of flat, fp32");
  m.def("shampoo_pack", &rfsdp::pack_symmetric, py::arg("full"),
        "A symmetric matrix's upper triangle, row by row (float32)");

  // Every rank's lines equal, or a ValueError on every rank naming the first
  // difference (collective; fully_shard's agreement).
  m.def("agree_lines", [](std::shared_ptr<rfsdp::Comm> comm, const std::vector<std::string>& lines,
                          const std::string& what) {
          py::gil_scoped_release release;  // collective
          rfsdp::agree_lines(*comm, lines, what);
        }, py::arg("comm"), py::arg("lines"), py::arg("what"));

  // The step gate from Python (comm None: this process alone): NaN/Inf in the
  // named gradients, or this rank's error, agreed by every rank; raises the agreed
  // error (ValueError where the first failing rank's was invalid_argument).
  // Collective: it meets the gate an optimizer's step() opens with.
  m.def("step_gate", [](std::shared_ptr<rfsdp::Comm> comm, const std::string& who,
                        const std::vector<std::pair<std::string, at::Tensor>>& grads,
                        const std::optional<std::string>& error, bool invalid_argument) {
          rfsdp::StepGate gate(comm.get(), who);
          for (const auto& [name, g] : grads) gate.check_finite(name, g);
          if (error) gate.fail(*error, invalid_argument);
          py::gil_scoped_release release;  // collective
          gate.agree();
        }, py::arg("comm"), py::arg("who"), py::arg("grads"), py::arg("error") = py::none(),
        py::arg("invalid_argument") = false);

  // (rows, row length) of a tensor seen as rows of its first row_dims dims: the
  // one definition (TensorSpec) that fully_shard, the policies and the optimizers use.
  m.def("row_geometry", [](const std::vector<int64_t>& shape, int row_dims) {
          const int max_row_dims = shape.empty() ? 1 : static_cast<int>(shape.size());
          if (row_dims < 1 || row_dims > max_row_dims) {
            throw std::invalid_argument("row_dims " + std::to_string(row_dims) +
                                        " is out of range [1, " + std::to_string(max_row_dims) +
                                        "] for shape " + rfsdp::shape_to_string(shape));
          }
          rfsdp::TensorSpec t;
          t.shape = shape;
          t.row_dims = row_dims;
          return py::make_tuple(t.rows(), t.row_elems());
        }, py::arg("shape"), py::arg("row_dims") = 1);

  m.def("plan_specs", &plan_specs, py::arg("specs"), py::arg("world_size"),
        py::arg("align_bytes") = 16, py::arg("max_buffers") = rfsdp::PlannerOptions{}.max_buffers,
        py::arg("collective_cost_bytes") = rfsdp::PlannerOptions{}.collective_cost_bytes);

  // The kernels alone, on the tensors' device (tests check them element by element;
  // benches time them without the entry points' argument and NaN checks). The
  // AdamW8bit step rounds v as the optimizer does (keep_nonzero: see CodeLut).
  m.def("adamw8bit_step", [](at::Tensor p, at::Tensor g, at::Tensor q1, at::Tensor a1, at::Tensor q2,
                             at::Tensor a2, const py::object& block, int64_t row_len,
                             const at::Tensor& code1, const at::Tensor& code2, double lr, double b1,
                             double b2, double eps, double wd, int64_t step) {
    const auto shape = block_shape(block);
    const int64_t n = p.numel();
    TORCH_CHECK(row_len > 0 && n % row_len == 0, "row_len ", row_len, " does not divide ", n);
    const rfsdp::quant::BlockLayout L(shape, n / row_len, row_len);
    const rfsdp::quant::AdamWHyper h{float(lr), float(b1), float(b2), float(eps), float(wd), step};
    if (p.is_cuda()) {
      rfsdp::quant::cuda_ops::adamw8bit_step(p, g, q1, a1, q2, a2, L, code1.to(p.device()),
                                             lut_of(code1), code2.to(p.device()), lut_of(code2, true), h);
      return;
    }
    expect(p, at::kFloat, n, "param");
    expect(g, at::kFloat, n, "grad");
    expect(q1, at::kByte, n, "q1");
    expect(q2, at::kByte, n, "q2");
    expect(a1, at::kFloat, L.num_blocks, "absmax1");
    expect(a2, at::kFloat, L.num_blocks, "absmax2");
    rfsdp::quant::cpu::adamw8bit_step(p.data_ptr<float>(), g.data_ptr<float>(),
                                      q1.data_ptr<uint8_t>(), a1.data_ptr<float>(),
                                      q2.data_ptr<uint8_t>(), a2.data_ptr<float>(), L,
                                      lut_of(code1), lut_of(code2, true), h);
  });
  m.def("cuda_quantize_into", [](const at::Tensor& x, const at::Tensor& code, const py::object& block,
                                 int64_t row_len, const at::Tensor& q, const at::Tensor& absmax) {
    rfsdp::quant::cuda_ops::quantize(x, rfsdp::quant::layout_of(x, block_shape(block), row_len),
                                     code, lut_of(code), q, absmax);
  });
  m.def("cuda_dequantize_into", [](const at::Tensor& q, const at::Tensor& absmax,
                                   const at::Tensor& code, const py::object& block, int64_t row_len,
                                   const at::Tensor& out) {
    rfsdp::quant::cuda_ops::dequantize(q, absmax,
                                       rfsdp::quant::layout_of(q, block_shape(block), row_len),
                                       code, out);
  });
  m.def("num_blocks", [](const py::object& block, int64_t rows, int64_t row_len) {
    return rfsdp::quant::BlockLayout(block_shape(block), rows, row_len).num_blocks;
  });
  m.def("check_whole_blocks", [](const py::object& block, const std::string& name,
                                 int64_t full_rows, int64_t row_len, int64_t row_begin,
                                 int64_t rows) {
    rfsdp::quant::check_whole_blocks(block_shape(block), name, full_rows, row_len, row_begin, rows);
  });
  m.def("granule_rows", [](const py::object& block, int64_t row_len) {
    return block_shape(block).granule_rows(row_len);
  });

  // Errors from the library are std::invalid_argument -> ValueError (pybind11's default).
  py::class_<rfsdp::Plan>(m, "Plan")
      .def_readonly("world_size", &rfsdp::Plan::world_size)
      .def_readonly("S", &rfsdp::Plan::shard_elems)
      .def_readonly("align_bytes", &rfsdp::Plan::align_bytes)
      .def_readonly("offsets", &rfsdp::Plan::offsets)  // in each tensor's buffer
      .def_property_readonly("buffers",  // S_b of each buffer (one collective each)
                             [](const rfsdp::Plan& p) {
                               std::vector<int64_t> s;
                               for (size_t b = 0; b < p.num_buffers(); ++b) s.push_back(p.buffer_shard(b));
                               return s;
                             })
      .def_property_readonly("buffer_of",
                             [](const rfsdp::Plan& p) {
                               std::vector<size_t> b;
                               for (size_t i = 0; i < p.tensors.size(); ++i) b.push_back(p.buffer_index(i));
                               return b;
                             })
      .def_readonly("plan_seconds", &rfsdp::Plan::plan_seconds)
      .def_property_readonly("padding_fraction", &rfsdp::Plan::padding_fraction)
      .def_property_readonly("lower_bound_S", &rfsdp::Plan::lower_bound_shard_elems)
      .def_property_readonly("names",
                             [](const rfsdp::Plan& p) {
                               std::vector<std::string> n;
                               for (const auto& t : p.tensors) n.push_back(t.name);
                               return n;
                             })
      .def("shard",
           [](const rfsdp::Plan& p, size_t i, int64_t rank) {
             const auto r = p.shard(i, rank);
             return py::make_tuple(r.row_begin, r.row_end, r.local_offset, r.numel);
           },
           "(row_begin, row_end, local_offset, numel) of tensor i on a rank")
      .def("to_json", [](const rfsdp::Plan& p) { return rfsdp::plan_to_json(p); });

  m.def("plan_json",
        [](const std::string& unit_json, int64_t world_size, int64_t align_bytes, int max_buffers,
           int64_t collective_cost_bytes) {
          return rfsdp::plan_unit(rfsdp::unit_from_json(unit_json), world_size, align_bytes,
                                  planner_options(max_buffers, collective_cost_bytes));
        },
        py::arg("unit_json"), py::arg("world_size"), py::arg("align_bytes") = 16,
        py::arg("max_buffers") = rfsdp::PlannerOptions{}.max_buffers,
        py::arg("collective_cost_bytes") = rfsdp::PlannerOptions{}.collective_cost_bytes);

  m.def("dynamic_map", &rfsdp::quant::dynamic_map, py::arg("signed") = true);
  m.def("code_map", &rfsdp::quant::code_map, py::arg("name"), py::arg("signed"));
  m.def("newton_schulz",
        [](const at::Tensor& g, int steps, const std::string& dtype) {
          return rfsdp::newton_schulz(g, steps, dtype_of(dtype));
        },
        py::arg("g"), py::arg("steps") = 5, py::arg("dtype") = "float32",
        "Muon's quintic Newton–Schulz of a matrix or a batch of matrices (float32 result)",
        py::call_guard<py::gil_scoped_release>());
  m.def("cuda_kernels_built", &rfsdp::quant::cuda_ops::built,
        "Whether this build has the CUDA quantisation kernels (nvcc was found)");
  m.def("quantize_blockwise",
        [](const at::Tensor& x, const at::Tensor& code, const py::object& block, int64_t row_len,
           bool keep_nonzero) {
          const auto q = rfsdp::quant::quantize_blockwise(x, code, block_shape(block), row_len,
                                                          keep_nonzero);
          return py::make_tuple(q.codes, q.absmax);
        },
        py::arg("x"), py::arg("code"), py::arg("block"), py::arg("row_len") = -1,
        py::arg("keep_nonzero") = false);
  m.def("dequantize_blockwise",
        [](const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code,
           const py::object& block, int64_t row_len, std::optional<at::Tensor> out) {
          return rfsdp::quant::dequantize_blockwise({codes, absmax}, code, block_shape(block),
                                                    row_len, out ? *out : at::Tensor());
        },
        py::arg("codes"), py::arg("absmax"), py::arg("code"), py::arg("block"),
        py::arg("row_len") = -1, py::arg("out") = py::none());
}
