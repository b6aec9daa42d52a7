// python/src/module.cpp — the extension module moerail._C: the C++ core for the Python package `moerail`.
// moerail.Error (a RuntimeError) carries every error of the core, its message naming the argument or the rank.
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "moerail/config.h"  // kMaxMlpChunks
#include "moerail/error.h"

namespace nb = nanobind;

NB_MODULE(_C, m) {
  nb::set_leak_warnings(false);  // objects alive at interpreter exit (cached layers) are not leaks worth a warning
  m.doc() = "moerail's C++ core (moerail._C); use the packages moerail and moerail.torch.";
  nb::exception<moerail::Error>(m, "Error", PyExc_RuntimeError);
  m.attr("__version__") = MOERAIL_VERSION;  // the file VERSION, through CMake
  m.attr("with_cuda") = bool(MOERAIL_WITH_CUDA);
  m.attr("with_nccl") = bool(MOERAIL_WITH_NCCL);
  m.attr("max_chunks") = int(moerail::kMaxMlpChunks);  // MoeLayerOptions::chunks
  moerail::py::bind_config(m);
  moerail::py::bind_reference(m);
#if MOERAIL_WITH_CUDA
  moerail::py::bind_gpu(m);
#endif
}
