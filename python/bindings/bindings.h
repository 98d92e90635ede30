// What the binding files of rfsdp._C share: pybind11 and torch's casters, and
// the conversions between Python's values and the library's that more than
// one of them uses (glue only: every behaviour lives in the library).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "core/comm/comm.h"
#include "quant/ops.h"

namespace rfsdp_bind {

namespace py = pybind11;

// An integer argument: a Python int (numpy's too; a bool is not one) that fits
// int64, else an std::invalid_argument (Python's ValueError) "<who>: <arg> must
// be <must>, got <repr>". Its range is the library's to check (check_config).
inline constexpr const char* kPositive = "a positive integer";
inline constexpr const char* kFits64 = "an integer that fits 64 bits";
inline int64_t int_arg(const py::object& v, const char* who, const char* arg,
                       const char* must = kPositive) {
  if (!py::isinstance<py::bool_>(v) && PyIndex_Check(v.ptr())) {
    int overflow = 0;
    const py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
    if (i) {
      const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
      if (!overflow && !(x == -1 && PyErr_Occurred())) return x;
    }
    PyErr_Clear();
  }
  throw std::invalid_argument(std::string(who) + ": " + arg + " must be " + must + ", got " +
                              py::repr(v).cast<std::string>());
}

inline rfsdp::quant::BlockShape block_shape(const py::object& block) {
  if (py::isinstance<py::int_>(block)) return rfsdp::quant::BlockShape::blocks(block.cast<int64_t>());
  auto t = block.cast<std::pair<int64_t, int64_t>>();
  return rfsdp::quant::BlockShape::tiles(t.first, t.second);
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

// A dtype as a checkpoint's settings name it: float32, bfloat16, float16, or int8 (8-bit codes).
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kByte: return "int8";
    default: return c10::toString(t);
  }
}

inline py::dict stats_dict(const rfsdp::CommStats& s) {
  return py::dict(py::arg("collectives") = s.collectives, py::arg("fallbacks") = s.fallbacks,
                  py::arg("gathers_native") = s.gathers_native,
                  py::arg("gathers_per_rank") = s.gathers_per_rank,
                  py::arg("reduce_scatters_native") = s.reduce_scatters_native,
                  py::arg("reduce_scatters_per_rank") = s.reduce_scatters_per_rank,
                  py::arg("reduce_scatters_all_to_all") = s.reduce_scatters_all_to_all,
                  py::arg("bytes_sent") = s.bytes_sent, py::arg("bytes_copied") = s.bytes_copied);
}

// One binding function per folder of the library (python/bindings/<folder>.cpp).
void bind_core(py::module_& m);
void bind_fsdp(py::module_& m);
void bind_quant(py::module_& m);
void bind_optimizers(py::module_& m);

}  // namespace rfsdp_bind
