// A C entry point into FlashInfer's fused all-reduce + residual add + RMSNorm kernel (its
// TensorRT-LLM "allreduce fusion"), for the FlashInfer column of bench/allreduce_norm.py. Loaded
// with ctypes (fusion.py). The headers come from the flashinfer-python wheel
// (tools/fetch_flashinfer.py); opfuse's own code never includes FlashInfer.
//
// Only what the comparison needs is instantiated: the residual + RMSNorm pattern (outputs: the
// new residual and the normalised rows), 16-bit activations, float32 accumulation of the rank sum
// (vLLM's setting) and world sizes 2, 4 and 8. The header's own dispatcher instantiates every
// quantisation pattern for every world size, which takes minutes to compile.
//
// The workspace is the device array FlashInfer's kernel reads (set up by fusion.py in torch
// symmetric memory): [two-shot buffers x world | barrier flags x world | Lamport buffers x world |
// this rank's control words].

#include <cstdint>
#include <exception>
#include <string>

#include "flashinfer/comm/trtllm_allreduce_fusion.cuh"

namespace {

namespace fi = flashinfer::trtllm_allreduce_fusion;

constexpr fi::AllReduceFusionPattern kPattern = fi::AllReduceFusionPattern::kARResidualRMSNorm;
constexpr bool kFp32Accumulation = true;

thread_local std::string g_error;

const char* fail(const std::string& message) {
  g_error = "flashinfer fusion: " + message;
  return g_error.c_str();
}

template <typename T, int World>
cudaError_t launch_for_world(const fi::AllReduceFusionParams<T>& params, bool pdl) {
  return fi::allreduce_fusion_kernel_launcher<kPattern, T, World, kFp32Accumulation>(params, pdl);
}

template <typename T>
const char* launch(int world, int rank, int64_t tokens, int64_t hidden, void* workspace, const void* x,
                   const void* residual_in, void* residual_out, void* norm_out, const void* gamma, float eps,
                   bool oneshot, bool pdl, bool trigger_at_end, cudaStream_t stream) {
  fi::AllReduceFusionParams<T> params;
  params.nranks = world;
  params.rank = rank;
  params.size = static_cast<int>(tokens * hidden);
  params.hidden_dim = static_cast<int>(hidden);
  params.workspace = static_cast<void**>(workspace);
  params.allreduce_in = const_cast<void*>(x);
  params.allreduce_out = nullptr;  // the pattern writes only the residual and the norm
  params.residual_in = const_cast<void*>(residual_in);
  params.residual_out = residual_out;
  params.norm_out = norm_out;
  params.quant_out = nullptr;
  params.scale_out = nullptr;
  params.rms_gamma = const_cast<void*>(gamma);
  params.rms_eps = eps;
  params.weight_bias = 0.f;  // plain RMSNorm: gamma * x * rsqrt(mean(x^2) + eps)
  params.scale_factor = nullptr;
  params.use_oneshot = oneshot;
  params.stream = stream;
  params.pattern = kPattern;
  params.trigger_completion_at_end = trigger_at_end;
  cudaError_t status;
  switch (world) {
    case 2: status = launch_for_world<T, 2>(params, pdl); break;
    case 4: status = launch_for_world<T, 4>(params, pdl); break;
    case 8: status = launch_for_world<T, 8>(params, pdl); break;
    default: return fail("world size " + std::to_string(world) + " not built (2, 4, 8)");
  }
  if (status != cudaSuccess) return fail(cudaGetErrorString(status));
  return nullptr;
}

}  // namespace

extern "C" {

// Bumped when the signature below changes; fusion.py checks it.
int opfuse_fiar_abi() { return 1; }

// y = rmsnorm(sum over ranks of x + residual_in) into norm_out, the sum + residual_in into
// residual_out. dtype: 1 bfloat16, 2 float16 (opfuse's codes). All pointers are device pointers
// except ``workspace``'s contents, which are device pointers too (a device array). Returns
// nullptr, or a message valid until the next call on this thread.
const char* opfuse_fiar_residual_rmsnorm(int dtype, int world, int rank, int64_t tokens, int64_t hidden,
                                         void* workspace, const void* x, const void* residual_in,
                                         void* residual_out, void* norm_out, const void* gamma, float eps,
                                         int oneshot, int pdl, int trigger_at_end, void* stream) {
  if (tokens <= 0 || hidden <= 0 || tokens * hidden > INT32_MAX)
    return fail("tokens x hidden must be in [1, 2^31): got " + std::to_string(tokens) + " x " +
                std::to_string(hidden));
  try {
    auto s = static_cast<cudaStream_t>(stream);
    if (dtype == 1)
      return launch<__nv_bfloat16>(world, rank, tokens, hidden, workspace, x, residual_in, residual_out, norm_out,
                                   gamma, eps, oneshot != 0, pdl != 0, trigger_at_end != 0, s);
    if (dtype == 2)
      return launch<half>(world, rank, tokens, hidden, workspace, x, residual_in, residual_out, norm_out, gamma,
                          eps, oneshot != 0, pdl != 0, trigger_at_end != 0, s);
    return fail("dtype code " + std::to_string(dtype) + " not built (1 bfloat16, 2 float16)");
  } catch (const std::exception& error) {  // FLASHINFER_CHECK throws flashinfer::Error
    return fail(error.what());
  }
}

}  // extern "C"
