// rfsdp._C: fsdp/ (FSDP units, clipping).
#include "python/bindings/bindings.h"

#include "fsdp/fsdp_unit.h"
#include "fsdp/grad_clip.h"

namespace rfsdp_bind {

void bind_fsdp(py::module_& m) {
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
}

}  // namespace rfsdp_bind
