// The rfsdp._C extension: the C++ library's pieces, bound for Python (torch
// tensors in and out). Glue only: every behaviour lives in the library.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"
#include "quant/blockwise/blockwise.h"
#include "quant/blockwise/code_maps.h"

namespace py = pybind11;

namespace {

rfsdp::quant::BlockShape block_shape(const py::object& block) {
  if (py::isinstance<py::int_>(block)) return rfsdp::quant::BlockShape::blocks(block.cast<int64_t>());
  auto t = block.cast<std::pair<int64_t, int64_t>>();
  return rfsdp::quant::BlockShape::tiles(t.first, t.second);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "RaggedFSDP C++ core";

  // Errors from the library are std::invalid_argument -> ValueError (pybind11's default).
  py::class_<rfsdp::Plan>(m, "Plan")
      .def_readonly("world_size", &rfsdp::Plan::world_size)
      .def_readonly("S", &rfsdp::Plan::shard_elems)
      .def_readonly("align_bytes", &rfsdp::Plan::align_bytes)
      .def_readonly("offsets", &rfsdp::Plan::offsets)
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
        [](const std::string& unit_json, int64_t world_size, int64_t align_bytes) {
          return rfsdp::plan_unit(rfsdp::unit_from_json(unit_json), world_size, align_bytes);
        },
        py::arg("unit_json"), py::arg("world_size"), py::arg("align_bytes") = 16);

  m.def("dynamic_map", &rfsdp::quant::dynamic_map, py::arg("signed") = true);
  m.def("linear_map", &rfsdp::quant::linear_map, py::arg("signed") = true);
  m.def("code_map", &rfsdp::quant::code_map, py::arg("name"), py::arg("signed"));
  m.def("quantize_blockwise",
        [](const at::Tensor& x, const at::Tensor& code, const py::object& block, int64_t row_len) {
          const auto q = rfsdp::quant::quantize_blockwise(x, code, block_shape(block), row_len);
          return py::make_tuple(q.codes, q.absmax);
        },
        py::arg("x"), py::arg("code"), py::arg("block"), py::arg("row_len") = -1);
  m.def("dequantize_blockwise",
        [](const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code,
           const py::object& block, int64_t row_len) {
          return rfsdp::quant::dequantize_blockwise({codes, absmax}, code, block_shape(block),
                                                    row_len);
        },
        py::arg("codes"), py::arg("absmax"), py::arg("code"), py::arg("block"),
        py::arg("row_len") = -1);
}
