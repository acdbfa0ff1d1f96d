// Element types the kernels take, as codes shared by every extension module. The Python side
// reads the codes from the module (``ext.DTYPES``, exported by pybind_codes.h), never from a copy.
#pragma once

namespace opfuse {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

}  // namespace opfuse
