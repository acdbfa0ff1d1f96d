// Single-GPU fused (bias +) residual add + RMSNorm/LayerNorm forward, and the RMSNorm backward.
//
// Forward: one pass over the data: read x (+ residual), write h (when asked) and y. Rows are
// spread over a grid-stride loop of blocks; a row stays in registers between the sum, the
// statistics and the normalisation, so each element is read once and written once.
//
// Backward (RMSNorm): for y = h * r * w with r = rsqrt(mean(h^2) + eps) and g = dy * w,
//   dh = r * (g - h * r^2 * mean(g * h))   (+ dh_out, the gradient of h's other use)
//   dw = sum over rows of dy * h * r
// One block reduction per row yields both sums (h^2 and g*h). dw is accumulated per block in
// registers and written as a float32 partial row; a second kernel sums the partials, so no
// atomics and a deterministic result.

#include "row.cuh"

namespace opfuse {
namespace {

template <typename T, int VPT>
__global__ void __launch_bounds__(kMaxThreads) add_norm_kernel(const ResidualNormArgs a) {
  __shared__ float scratch[33];
  const int nvec = static_cast<int>(a.hidden / Pack<T>::kElems);
  const uint4* x = static_cast<const uint4*>(a.x);
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    RowRegs<T, VPT> regs;
    regs.zero();
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx < nvec) regs.add(j, __ldg(x + row * nvec + idx));
    }
    finish_row<T, VPT>(regs, row, a, nvec, scratch);
  }
}

template <typename T, int VPT>
__global__ void __launch_bounds__(kMaxThreads) rms_backward_kernel(const RMSNormBackwardArgs a) {
  __shared__ float2 scratch[33];
  constexpr int E = Pack<T>::kElems;
  const int nvec = static_cast<int>(a.hidden / E);
  const float inv_h = 1.f / static_cast<float>(a.hidden);
  const uint4* dy = static_cast<const uint4*>(a.dy);
  const uint4* h = static_cast<const uint4*>(a.h);
  const uint4* w = static_cast<const uint4*>(a.weight);
  const uint4* dh_out = static_cast<const uint4*>(a.dh_out);
  uint4* dh = static_cast<uint4*>(a.dh);
  float dw_acc[VPT][E];
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int e = 0; e < E; ++e) dw_acc[j][e] = 0.f;

  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    float hv[VPT][E], gv[VPT][E], dyv[VPT][E];
    float2 sums = make_float2(0.f, 0.f);  // (sum h^2, sum g*h)
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      Pack<T> ph, pdy, pw;
      if (idx < nvec) {
        ph.raw = __ldg(h + row * nvec + idx);
        pdy.raw = __ldg(dy + row * nvec + idx);
        if (w) pw.raw = __ldg(w + idx);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const bool valid = idx < nvec;
        hv[j][e] = valid ? Elem<T>::to_float(ph.elems[e]) : 0.f;
        dyv[j][e] = valid ? Elem<T>::to_float(pdy.elems[e]) : 0.f;
        gv[j][e] = (valid && w) ? dyv[j][e] * Elem<T>::to_float(pw.elems[e]) : dyv[j][e];
        sums.x += hv[j][e] * hv[j][e];
        sums.y += gv[j][e] * hv[j][e];
      }
    }
    sums = block_sum(sums, scratch);
    const float rstd = rsqrtf(sums.x * inv_h + a.eps);
    const float coef = rstd * rstd * sums.y * inv_h;  // r^2 * mean(g * h)
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx >= nvec) continue;
      Pack<T> out, extra;
      if (dh_out) extra.raw = __ldg(dh_out + row * nvec + idx);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float value = rstd * (gv[j][e] - hv[j][e] * coef);
        if (dh_out) value += Elem<T>::to_float(extra.elems[e]);
        out.elems[e] = Elem<T>::from_float(value);
        dw_acc[j][e] += dyv[j][e] * hv[j][e] * rstd;
      }
      dh[row * nvec + idx] = out.raw;
    }
  }
  if (!a.dw_partial) return;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int idx = j * blockDim.x + threadIdx.x;
    if (idx >= nvec) continue;
    float* dst = a.dw_partial + blockIdx.x * a.hidden + static_cast<int64_t>(idx) * E;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[e] = dw_acc[j][e];
  }
}

template <typename T>
__global__ void sum_partials_kernel(const float* partial, int blocks, int64_t hidden, T* out) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < hidden;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = 0.f;
    for (int b = 0; b < blocks; ++b) total += partial[b * hidden + k];
    out[k] = Elem<T>::from_float(total);
  }
}

}  // namespace

const char* add_norm(const ResidualNormArgs& args, int max_blocks, cudaStream_t stream) {
  if (const char* bad = check_residual_norm_args(args)) return bad;
  if (args.tokens == 0) return nullptr;
  const RowLayout layout = row_layout(args.hidden, args.dtype);
  const int blocks = static_cast<int>(args.tokens < max_blocks ? args.tokens : max_blocks);
  return dispatch_row_kernel(args.dtype, layout.vpt, [&]<typename T, int VPT>() -> const char* {
    add_norm_kernel<T, VPT><<<blocks, layout.threads, 0, stream>>>(args);
    return launch_status();
  });
}

const char* rms_norm_backward(const RMSNormBackwardArgs& args, int blocks, cudaStream_t stream) {
  ResidualNormArgs shape;
  shape.x = args.dy;
  shape.y = args.dh;
  shape.residual = args.h;
  shape.weight = args.weight;
  shape.bias = args.dh_out;
  shape.tokens = args.tokens;
  shape.hidden = args.hidden;
  shape.dtype = args.dtype;
  if (const char* bad = check_residual_norm_args(shape)) return bad;
  if (args.weight && (!args.dw || !args.dw_partial)) return "opfuse rms_norm_backward: dw and dw_partial are required with a weight";
  if (blocks < 1) return "opfuse rms_norm_backward: blocks must be >= 1";
  const RowLayout layout = row_layout(args.hidden, args.dtype);
  return dispatch_row_kernel(args.dtype, layout.vpt, [&]<typename T, int VPT>() -> const char* {
    if (args.tokens > 0) {
      rms_backward_kernel<T, VPT><<<blocks, layout.threads, 0, stream>>>(args);
      if (const char* err = launch_status()) return err;
    } else if (args.weight) {
      if (cudaMemsetAsync(args.dw_partial, 0, sizeof(float) * blocks * args.hidden, stream) != cudaSuccess)
        return launch_status();
    }
    if (args.weight) {
      sum_partials_kernel<T><<<static_cast<int>((args.hidden + 255) / 256), 256, 0, stream>>>(
          args.dw_partial, blocks, args.hidden, static_cast<T*>(args.dw));
      return launch_status();
    }
    return nullptr;
  });
}

}  // namespace opfuse
