// What the binding files of rfsdp._C share: pybind11, the library's headers
// they bind, and the small conversions between Python's values and the
// library's (glue only: every behaviour lives in the library).
#pragma once

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

namespace rfsdp_bind {

namespace py = pybind11;


inline rfsdp::quant::BlockShape block_shape(const py::object& block) {
  if (py::isinstance<py::int_>(block)) return rfsdp::quant::BlockShape::blocks(block.cast<int64_t>());
  auto t = block.cast<std::pair<int64_t, int64_t>>();
  return rfsdp::quant::BlockShape::tiles(t.first, t.second);
}

// basis_dtype "int8" / "int4": its bits; anything else 0.
inline int lowbit_bits(const std::string& basis_dtype) {
  return basis_dtype == "int8" ? 8 : basis_dtype == "int4" ? 4 : 0;
}

// The planner's options from Python (plan_unit checks them).
inline rfsdp::PlannerOptions planner_options(int max_buffers, int64_t collective_cost_bytes) {
  rfsdp::PlannerOptions o;
  o.max_buffers = max_buffers;
  o.collective_cost_bytes = collective_cost_bytes;
  return o;
}

// Plans from Python's spec list: [(name, shape, granule_rows (0 = whole), row_dims, dtype_bytes)].
inline rfsdp::Plan plan_specs(const std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, int,
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
inline at::ScalarType dtype_of(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float64") return at::kDouble;
  throw std::invalid_argument("unsupported dtype '" + name +
                              "': use float32, bfloat16, float16 or float64");
}

// The raw kernels below trust their pointers: check sizes and dtypes here.
inline void expect(const at::Tensor& t, at::ScalarType dt, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.device().is_cpu() && t.numel() == n,
              what, ": expected a contiguous CPU tensor of ", n, " ", c10::toString(dt),
              " elements, got ", t.numel(), " ", c10::toString(t.scalar_type()));
}

inline const rfsdp::quant::cpu::CodeLut& lut_of(const at::Tensor& code, bool keep_nonzero = false) {
  // code_lut caches per distinct code; the shared_ptr it returns stays in the cache.
  return *rfsdp::quant::code_lut(code, keep_nonzero);
}

// A Comm over a torch.distributed group, with a timeout in seconds as Python
// gives it. Destroying it may destroy the group, whose Gloo worker threads can
// need the GIL to free Python-owned tensors while it joins them: the GIL is
// released for that.
inline std::shared_ptr<rfsdp::Comm> make_comm(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
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

inline py::dict stats_dict(const rfsdp::CommStats& s) {
  return py::dict(py::arg("collectives") = s.collectives, py::arg("fallbacks") = s.fallbacks,
                  py::arg("gathers_native") = s.gathers_native,
                  py::arg("gathers_per_rank") = s.gathers_per_rank,
                  py::arg("reduce_scatters_native") = s.reduce_scatters_native,
                  py::arg("reduce_scatters_per_rank") = s.reduce_scatters_per_rank,
                  py::arg("bytes_sent") = s.bytes_sent, py::arg("bytes_copied") = s.bytes_copied);
}

// An optimizer's parameter from Python: its shard descriptor and this rank's tensor.
using ShardOf = std::pair<rfsdp::TensorShard, at::Tensor>;

inline std::vector<rfsdp::ParamShard> shards_of(const std::vector<ShardOf>& given) {
  std::vector<rfsdp::ParamShard> out;
  for (const auto& [shard, param] : given) out.emplace_back(shard, param);
  return out;
}

inline py::dict named(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  py::dict d;
  for (const auto& [name, t] : tensors) d[py::str(name)] = t;
  return d;
}


// One binding function per folder of the library (python/bindings/<folder>.cpp).
void bind_core(py::module_& m);
void bind_fsdp(py::module_& m);
void bind_quant(py::module_& m);
void bind_optimizers(py::module_& m);

}  // namespace rfsdp_bind
