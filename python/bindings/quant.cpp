// rfsdp._C: quant/ (block quantisation: maps, codes, kernels).
#include "python/bindings/bindings.h"

#include "quant/ops.h"

namespace rfsdp_bind {

namespace {

const rfsdp::quant::cpu::CodeLut& lut_of(const at::Tensor& code, bool keep_nonzero = false) {
  // code_lut caches per distinct code; the shared_ptr it returns stays in the cache.
  return *rfsdp::quant::code_lut(code, keep_nonzero);
}

}  // namespace

void bind_quant(py::module_& m) {
  // The state steps alone, on the tensors' device (tests check them element by
  // element; benches time them). The AdamW8bit step rounds v as the optimizer
  // does (keep_nonzero: see CodeLut).
  // state_format "float8_e4m3fn": the codes are e4m3 (code1, code2 unused).
  m.def("adamw8bit_step", [](at::Tensor p, at::Tensor g, at::Tensor q1, at::Tensor a1, at::Tensor q2,
                             at::Tensor a2, const py::object& block, int64_t row_len,
                             const at::Tensor& code1, const at::Tensor& code2, double lr, double b1,
                             double b2, double eps, double wd, int64_t step,
                             const std::string& state_format) {
    const auto shape = block_shape(block);
    const int64_t n = p.numel();
    TORCH_CHECK(row_len > 0 && n % row_len == 0, "row_len ", row_len, " does not divide ", n);
    const rfsdp::quant::BlockLayout L(shape, n / row_len, row_len);
    const rfsdp::quant::AdamWHyper h{float(lr), float(b1), float(b2), float(eps), float(wd), step};
    // (on the path the tensors' device and the switch choose: quant/ops/state_ops.h)
    if (rfsdp::quant::state_format(state_format) == rfsdp::quant::StateFormat::kFloat8E4M3) {
      rfsdp::quant::adamw8bit_step(p, g, q1, a1, q2, a2, L, rfsdp::quant::Codec::float8_e4m3(false),
                                   rfsdp::quant::Codec::float8_e4m3(true), h);
      return;
    }
    rfsdp::quant::adamw8bit_step(p, g, q1, a1, q2, a2, L, rfsdp::quant::Codec(code1),
                                 rfsdp::quant::Codec(code2, /*keep_nonzero=*/true), h);
  }, py::arg("p"), py::arg("g"), py::arg("q1"), py::arg("a1"), py::arg("q2"), py::arg("a2"),
     py::arg("block"), py::arg("row_len"), py::arg("code1"), py::arg("code2"), py::arg("lr"),
     py::arg("b1"), py::arg("b2"), py::arg("eps"), py::arg("wd"), py::arg("step"),
     py::arg("state_format") = "dynamic");
  m.def("quantize_blockwise_fp8",
        [](const at::Tensor& x, const py::object& block, int64_t row_len, bool keep_nonzero) {
          const auto q = rfsdp::quant::quantize_blockwise(
              x, rfsdp::quant::Codec::float8_e4m3(keep_nonzero), block_shape(block), row_len);
          return py::make_tuple(q.codes, q.absmax);
        },
        py::arg("x"), py::arg("block"), py::arg("row_len") = -1, py::arg("keep_nonzero") = false);
  m.def("dequantize_blockwise_fp8",
        [](const at::Tensor& codes, const at::Tensor& absmax, const py::object& block,
           int64_t row_len, std::optional<at::Tensor> out) {
          return rfsdp::quant::dequantize_blockwise({codes, absmax},
                                                    rfsdp::quant::Codec::float8_e4m3(false),
                                                    block_shape(block), row_len,
                                                    out ? *out : at::Tensor());
        },
        py::arg("codes"), py::arg("absmax"), py::arg("block"), py::arg("row_len") = -1,
        py::arg("out") = py::none());
  m.def("momentum8bit_step", [](const at::Tensor& g, const at::Tensor& q, const at::Tensor& absmax,
                                int64_t block, const at::Tensor& code, double beta, bool nesterov,
                                const at::Tensor& q_out, const at::Tensor& absmax_out,
                                const at::Tensor& u) {
    const rfsdp::quant::BlockLayout L(rfsdp::quant::BlockShape::blocks(block), 1, g.numel());
    rfsdp::quant::momentum8bit_step(g, q, absmax, L, rfsdp::quant::Codec(code), float(beta),
                                    nesterov, q_out, absmax_out, u);
  });
  m.def("use_device_generic_path", &rfsdp::quant::use_device_generic_path, py::arg("on"),
        "Run every quantised operation (8-bit states, the weights' codes) on the device-generic "
        "ATen path, as a device without kernels does, on the CPU too (RFSDP_DEVICE_GENERIC=1 at "
        "load does the same).");
  m.def("device_generic_path", &rfsdp::quant::device_generic_path);
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

  m.def("dynamic_map", &rfsdp::quant::dynamic_map, py::arg("signed") = true);
  m.def("code_map", &rfsdp::quant::code_map, py::arg("name"), py::arg("signed"));
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

}  // namespace rfsdp_bind
