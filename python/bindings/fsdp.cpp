// rfsdp._C: fsdp/ (FSDP units, clipping).
#include "python/bindings/bindings.h"

#include "fsdp/fsdp_unit.h"
#include "fsdp/grad_clip.h"

namespace rfsdp_bind {

namespace {

// A dtype or its name, as Python spells either ("int8", torch.int8); None: none.
std::optional<std::string> dtype_name_arg(const py::object& v) {
  if (v.is_none()) return std::nullopt;
  if (THPDtype_Check(v.ptr())) return std::string(c10::toString(v.cast<at::ScalarType>())) == "Char"
                                          ? "int8" : py::str(v).cast<std::string>().substr(6);
  if (py::isinstance<py::str>(v)) return v.cast<std::string>();
  throw std::invalid_argument("CommPolicy: expected None, a name or a torch.dtype, got " +
                              py::repr(v).cast<std::string>());
}

}  // namespace

void bind_fsdp(py::module_& m) {
  py::class_<rfsdp::CommPolicy>(m, "CommPolicy", R"(How fully_shard's collectives carry a unit's data.

weights: None (the compute dtype), "int8" or "float8_e4m3fn": each rank encodes its own
slice in blocks of weight_block consecutive elements of each tensor, counted from the
global tensor's start (fully_shard plans with a granule that keeps blocks whole), one
fp32 scale absmax/127 (int8: codes round half to even, clamped to +-127) or absmax/448
(float8_e4m3fn: torch's cast) a block; codes and scales are all-gathered and decoded to
code * scale in the compute dtype. The shards keep fp32 master weights; the gradient of
the decoded weight is the gradient applied to them. The same codes on every world size.
gradients: None (the reduce dtype) or torch.bfloat16: sent in bf16, summed in fp32 by the
rank that keeps them (and across HSDP replicas alike), then averaged.)")
      .def(py::init([](const py::object& weights, int64_t weight_block, const py::object& gradients) {
             std::optional<at::ScalarType> g;
             const auto gname = dtype_name_arg(gradients);
             if (gname) {
               if (*gname != "bfloat16" && *gname != "float32" && *gname != "float16") {
                 throw std::invalid_argument("CommPolicy: gradients='" + *gname + "' is not "
                                             "supported; use None or torch.bfloat16");
               }
               g = dtype_of(*gname);
             }
             return rfsdp::CommPolicy::parse(dtype_name_arg(weights), weight_block, g);
           }),
           py::kw_only(), py::arg("weights") = py::none(), py::arg("weight_block") = 256,
           py::arg("gradients") = py::none())
      .def_property_readonly("weights", [](const rfsdp::CommPolicy& p) -> py::object {
        if (!p.quantised_weights()) return py::none();
        return py::str(p.weights_name());
      })
      .def_readonly("weight_block", &rfsdp::CommPolicy::weight_block)
      .def_property_readonly("gradients", [](const rfsdp::CommPolicy& p) -> py::object {
        if (!p.gradients) return py::none();
        return py::module_::import("torch").attr(dtype_name(*p.gradients).c_str());
      })
      .def("quantised_weights", &rfsdp::CommPolicy::quantised_weights)
      .def("describe", &rfsdp::CommPolicy::describe)
      .def("__eq__", [](const rfsdp::CommPolicy& a, const py::object& b) {
        return py::isinstance<rfsdp::CommPolicy>(b) && a == b.cast<rfsdp::CommPolicy>();
      })
      .def("__hash__", [](const rfsdp::CommPolicy& p) { return py::hash(py::str(p.describe())); })
      .def("__repr__", [](const rfsdp::CommPolicy& p) {
        std::string s = "CommPolicy(weights=";
        s += p.quantised_weights() ? "'" + p.weights_name() + "'" : "None";
        s += ", weight_block=" + std::to_string(p.weight_block) + ", gradients=";
        s += p.gradients ? "torch." + dtype_name(*p.gradients) : "None";
        return s + ")";
      });
  m.def("quantize_weight_blocks", [](const at::Tensor& x, const rfsdp::CommPolicy& policy) {
          // One piece that starts on a block edge, as a rank encodes it: (codes, scales).
          if (!policy.quantised_weights()) throw std::invalid_argument("quantize_weight_blocks: weights=None");
          const at::Tensor w = x.contiguous().view(-1).to(at::kFloat);
          at::Tensor codes = at::empty({w.numel()}, w.options().dtype(policy.code_dtype()));
          at::Tensor scales = at::empty({(w.numel() + policy.weight_block - 1) / policy.weight_block},
                                        w.options());
          rfsdp::QuantizedGather::encode_piece(w, policy.weight_block, policy, codes, scales);
          return py::make_tuple(codes, scales);
        }, py::arg("x"), py::arg("policy"));
  m.def("dequantize_weight_blocks", [](const at::Tensor& codes, const at::Tensor& scales,
                                       const rfsdp::CommPolicy& policy, at::Tensor out) {
          rfsdp::QuantizedGather::decode_piece(codes, scales, policy.weight_block, policy, out);
          return out;
        }, py::arg("codes"), py::arg("scales"), py::arg("policy"), py::arg("out"));

  py::class_<rfsdp::FSDPUnit, std::shared_ptr<rfsdp::FSDPUnit>>(m, "FSDPUnit")
      .def(py::init([](std::shared_ptr<rfsdp::Comm> comm, const rfsdp::Plan& plan,
                       const std::string& param_dtype, const std::string& reduce_dtype,
                       std::shared_ptr<rfsdp::Comm> replicate, const std::string& device,
                       bool agree, const std::optional<rfsdp::CommPolicy>& comm_policy) {
             return std::make_shared<rfsdp::FSDPUnit>(
                 std::move(comm), std::move(replicate), plan,
                 rfsdp::MixedPrecision{dtype_of(param_dtype), dtype_of(reduce_dtype)},
                 comm_policy.value_or(rfsdp::CommPolicy{}), at::Device(device), agree);
           }),
           py::arg("comm"), py::arg("plan"), py::arg("param_dtype"), py::arg("reduce_dtype"),
           py::arg("replicate") = nullptr, py::arg("device") = "cpu", py::arg("agree") = true,
           py::arg("comm_policy") = py::none(),
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
      .def("stats", [](rfsdp::FSDPUnit& u) { return stats_dict(u.comm().stats()); })
      .def("comm_policy", &rfsdp::FSDPUnit::comm_policy)
      .def("gather_bytes_sent", &rfsdp::FSDPUnit::gather_bytes_sent)
      .def("reduce_bytes_sent", &rfsdp::FSDPUnit::reduce_bytes_sent)
      .def("bytes_sent", &rfsdp::FSDPUnit::bytes_sent)
      .def("reset_bytes_sent", &rfsdp::FSDPUnit::reset_bytes_sent);

  m.def("clip_grad_norm", [](const std::vector<std::shared_ptr<rfsdp::FSDPUnit>>& units,
                             double max_norm, bool error_if_nonfinite) {
          std::vector<rfsdp::FSDPUnit*> raw;
          for (const auto& u : units) raw.push_back(u.get());
          py::gil_scoped_release release;
          return rfsdp::clip_grad_norm(raw, max_norm, error_if_nonfinite);
        });
}

}  // namespace rfsdp_bind
