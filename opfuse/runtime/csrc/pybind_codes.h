// Exports the shared codes (runtime/csrc/dtype.h) into an extension module, so Python maps
// torch dtypes to kernel codes from the module itself.
#pragma once

#include <pybind11/pybind11.h>

#include "dtype.h"

namespace opfuse {

inline void export_dtype_codes(pybind11::module_& m) {
  pybind11::dict codes;
  codes["float32"] = static_cast<int>(DType::kFloat32);
  codes["bfloat16"] = static_cast<int>(DType::kBFloat16);
  codes["float16"] = static_cast<int>(DType::kFloat16);
  m.attr("DTYPES") = codes;
}

}  // namespace opfuse
