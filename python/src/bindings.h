// python/src/bindings.h — the parts of the extension module moerail._C, one function per source file.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "moerail/config.h"

namespace moerail::py {

namespace nb = nanobind;

void bind_config(nb::module_& m);     // bind_config.cpp
void bind_reference(nb::module_& m);  // bind_reference.cpp
void bind_gpu(nb::module_& m);        // bind_gpu.cpp (built with CUDA only)

// "in-activation" | "in-combine"; anything else throws Error naming prob_mode (bind_config.cpp).
ProbMode parse_prob_mode(const std::string& s);

}  // namespace moerail::py
