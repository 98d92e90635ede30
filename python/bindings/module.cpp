// The rfsdp._C extension: the C++ library's pieces, bound for Python (torch
// tensors in and out), one binding file per folder of the library.
#include "python/bindings/bindings.h"
#include "rfsdp_version.h"  // generated (cmake/rfsdp_version.h.in)

PYBIND11_MODULE(_C, m) {
  m.doc() = "RaggedFSDP C++ core";
  m.attr("__version__") = RFSDP_VERSION;
  rfsdp_bind::bind_core(m);
  rfsdp_bind::bind_fsdp(m);
  rfsdp_bind::bind_quant(m);
  rfsdp_bind::bind_optimizers(m);
}
