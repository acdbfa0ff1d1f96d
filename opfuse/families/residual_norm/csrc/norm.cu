// Single-GPU fused (bias +) residual add + RMSNorm/LayerNorm forward, and both norms' backward.
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
//
// Backward (LayerNorm): for y = xhat * w + b with xhat = (h - mean) * r, r = rsqrt(var(h) + eps)
// and g = dy * w,
//   dh = r * (g - mean(g) - xhat * mean(g * xhat))   (+ dh_out)
//   dw = sum over rows of dy * xhat,   db = sum over rows of dy
// mean and r are recomputed from h (the forward saves only h), with the forward's two passes:
// one block reduction yields (sum h, sum g), a second one (sum (h - mean)^2, sum g * (h - mean)).
// dw and db take the RMSNorm scheme (per-block float32 partial rows, summed by a second kernel).
// Rows that are not whole 16-byte packs at 16-byte aligned addresses take a scalar kernel that
// reads each row three times (from L1/L2) instead of holding it in registers.

#include <cstdarg>
#include <cstdio>

#include "row.cuh"

namespace opfuse {
namespace {

template <typename T, int VPT, QuantMode Q>
__global__ void __launch_bounds__(kMaxThreads) add_norm_kernel(const ResidualNormArgs a) {
  __shared__ float scratch[33];
  const int nvec = static_cast<int>(a.hidden / Pack<T>::kElems);
  WholeRow whole{0, nvec};
  const uint4* x = static_cast<const uint4*>(a.x);
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    RowRegs<T, VPT> regs;
    regs.zero();
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx < nvec) regs.add(j, __ldg(x + row * nvec + idx));
    }
    finish_row<T, VPT, Q>(regs, row, a, nvec, scratch, whole);
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

// Column sums of float32 partial rows: out0[k] = sum over b of partial[b, k]; with ``slabs`` == 2,
// out1 likewise from the next [blocks, hidden] slab (a null output's slab is skipped). A block
// takes 32 adjacent columns (coalesced reads); each of its kSumGroups thread rows sums every
// kSumGroups-th partial row in order, then thread row 0 adds the groups in order: a fixed order
// (deterministic) with blocks / kSumGroups loads per thread instead of blocks.
constexpr int kSumLanes = 32, kSumGroups = 8;

template <typename T>
__global__ void __launch_bounds__(kSumLanes * kSumGroups)
    sum_partials_kernel(const float* partial, int blocks, int64_t hidden, int slabs, T* out0, T* out1) {
  __shared__ float group_sums[kSumGroups][kSumLanes + 1];
  const int64_t columns = slabs * hidden;
  for (int64_t base = blockIdx.x * static_cast<int64_t>(kSumLanes); base < columns;
       base += static_cast<int64_t>(gridDim.x) * kSumLanes) {  // uniform over the block: barriers are safe
    const int64_t k = base + threadIdx.x;
    const int slab = k < hidden ? 0 : 1;
    T* out = slab ? out1 : out0;
    const int64_t col = k - slab * hidden;
    const bool active = k < columns && out != nullptr;
    float total = 0.f;
    if (active) {
      const float* src = partial + slab * blocks * hidden + col;
#pragma unroll 4
      for (int b = threadIdx.y; b < blocks; b += kSumGroups) total += src[b * hidden];
    }
    group_sums[threadIdx.y][threadIdx.x] = total;
    __syncthreads();
    if (threadIdx.y == 0 && active) {
      float sum = 0.f;
#pragma unroll
      for (int g = 0; g < kSumGroups; ++g) sum += group_sums[g][threadIdx.x];
      out[col] = Elem<T>::from_float(sum);
    }
    __syncthreads();
  }
}

// The row stays in registers as its raw packs (h and dy, converted to float where used: half
// the registers of floats for 16-bit types), next to the float32 dw/db accumulators; g = dy * w
// is recomputed from the weight (an L1 hit) in each pass rather than held.
template <typename T, int VPT>
__global__ void __launch_bounds__(kMaxThreads) layer_backward_kernel(const LayerNormBackwardArgs a) {
  __shared__ float2 scratch[33];
  constexpr int E = Pack<T>::kElems;
  const int nvec = static_cast<int>(a.hidden / E);
  const float inv_h = 1.f / static_cast<float>(a.hidden);
  const uint4* dy = static_cast<const uint4*>(a.dy);
  const uint4* h = static_cast<const uint4*>(a.h);
  const uint4* w = static_cast<const uint4*>(a.weight);
  const uint4* dh_out = static_cast<const uint4*>(a.dh_out);
  uint4* dh = static_cast<uint4*>(a.dh);
  auto weights = [&](int idx) {
    Pack<T> p;
    p.raw = w ? __ldg(w + idx) : uint4{};
    return p;
  };
  auto grad_in = [&](float dyv, const Pack<T>& pw, int e) {
    return w ? dyv * Elem<T>::to_float(pw.elems[e]) : dyv;
  };
  float dw_acc[VPT][E], db_acc[VPT][E];
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int e = 0; e < E; ++e) dw_acc[j][e] = db_acc[j][e] = 0.f;

  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    Pack<T> ph[VPT], pdy[VPT];
    float2 sums = make_float2(0.f, 0.f);  // (sum h, sum g)
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx >= nvec) continue;  // padding packs are never read again
      ph[j].raw = __ldg(h + row * nvec + idx);
      pdy[j].raw = __ldg(dy + row * nvec + idx);
      const Pack<T> pw = weights(idx);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        sums.x += Elem<T>::to_float(ph[j].elems[e]);
        sums.y += grad_in(Elem<T>::to_float(pdy[j].elems[e]), pw, e);
      }
    }
    sums = block_sum(sums, scratch);
    const float mean = sums.x * inv_h, mean_g = sums.y * inv_h;
    float2 centered = make_float2(0.f, 0.f);  // (sum d^2, sum g*d) with d = h - mean
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx >= nvec) continue;
      const Pack<T> pw = weights(idx);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float d = Elem<T>::to_float(ph[j].elems[e]) - mean;
        centered.x += d * d;
        centered.y += grad_in(Elem<T>::to_float(pdy[j].elems[e]), pw, e) * d;
      }
    }
    centered = block_sum(centered, scratch);
    const float rstd = rsqrtf(centered.x * inv_h + a.eps);
    const float coef = rstd * rstd * centered.y * inv_h;  // xhat * mean(g * xhat) = d * coef
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx >= nvec) continue;
      const Pack<T> pw = weights(idx);
      Pack<T> out, extra;
      if (dh_out) extra.raw = __ldg(dh_out + row * nvec + idx);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float d = Elem<T>::to_float(ph[j].elems[e]) - mean;
        const float dyv = Elem<T>::to_float(pdy[j].elems[e]);
        float value = rstd * (grad_in(dyv, pw, e) - mean_g - d * coef);
        if (dh_out) value += Elem<T>::to_float(extra.elems[e]);
        out.elems[e] = Elem<T>::from_float(value);
        dw_acc[j][e] += dyv * d * rstd;
        db_acc[j][e] += dyv;
      }
      dh[row * nvec + idx] = out.raw;
    }
  }
  if (!a.partial) return;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int idx = j * blockDim.x + threadIdx.x;
    if (idx >= nvec) continue;
    const int64_t col = static_cast<int64_t>(idx) * E;
    float* dw_dst = a.partial + blockIdx.x * a.hidden + col;
    float* db_dst = a.partial + (gridDim.x + blockIdx.x) * a.hidden + col;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      dw_dst[e] = dw_acc[j][e];
      db_dst[e] = db_acc[j][e];
    }
  }
}

// The same arithmetic one element at a time, for rows that are not whole aligned packs (odd
// hidden sizes, offset views). The row is re-read in each of the three passes; each thread's
// dw/db partials live in its block's partial rows (only that thread touches its columns).
template <typename T>
__global__ void __launch_bounds__(kMaxThreads) layer_backward_scalar_kernel(const LayerNormBackwardArgs a) {
  __shared__ float2 scratch[33];
  const int64_t hidden = a.hidden;
  const float inv_h = 1.f / static_cast<float>(hidden);
  const T* w = static_cast<const T*>(a.weight);
  float* dw_part = a.partial ? a.partial + blockIdx.x * hidden : nullptr;
  float* db_part = a.partial ? a.partial + (gridDim.x + blockIdx.x) * hidden : nullptr;
  if (dw_part)
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) dw_part[c] = db_part[c] = 0.f;
  auto grad_in = [&](float dyv, int64_t c) { return w ? dyv * Elem<T>::to_float(w[c]) : dyv; };

  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    const T* h = static_cast<const T*>(a.h) + row * hidden;
    const T* dy = static_cast<const T*>(a.dy) + row * hidden;
    float2 sums = make_float2(0.f, 0.f);  // (sum h, sum g)
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      sums.x += Elem<T>::to_float(h[c]);
      sums.y += grad_in(Elem<T>::to_float(dy[c]), c);
    }
    sums = block_sum(sums, scratch);
    const float mean = sums.x * inv_h, mean_g = sums.y * inv_h;
    float2 centered = make_float2(0.f, 0.f);  // (sum d^2, sum g*d)
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      const float d = Elem<T>::to_float(h[c]) - mean;
      centered.x += d * d;
      centered.y += grad_in(Elem<T>::to_float(dy[c]), c) * d;
    }
    centered = block_sum(centered, scratch);
    const float rstd = rsqrtf(centered.x * inv_h + a.eps);
    const float coef = rstd * rstd * centered.y * inv_h;
    const T* extra = a.dh_out ? static_cast<const T*>(a.dh_out) + row * hidden : nullptr;
    T* out = static_cast<T*>(a.dh) + row * hidden;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      const float d = Elem<T>::to_float(h[c]) - mean;
      const float dyv = Elem<T>::to_float(dy[c]);
      float value = rstd * (grad_in(dyv, c) - mean_g - d * coef);
      if (extra) value += Elem<T>::to_float(extra[c]);
      out[c] = Elem<T>::from_float(value);
      if (dw_part) {
        dw_part[c] += dyv * d * rstd;
        db_part[c] += dyv;
      }
    }
  }
}

// --- Host side ------------------------------------------------------------------------------

// Formats a failure message naming the offending values (thread-local: valid until the calling
// thread's next failure).
const char* failure(const char* format, ...) {
  thread_local char message[320];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  return message;
}

template <typename T>
const char* launch_sum_partials(const float* partial, int blocks, int64_t hidden, T* out0, T* out1,
                                cudaStream_t stream) {
  const int slabs = out1 ? 2 : 1;
  const int64_t grid = (slabs * hidden + kSumLanes - 1) / kSumLanes;
  sum_partials_kernel<T><<<static_cast<int>(grid < (1 << 20) ? grid : (1 << 20)), dim3(kSumLanes, kSumGroups), 0,
                           stream>>>(partial, blocks, hidden, slabs, out0, out1);
  return launch_status();
}

const char* check_layer_backward_args(const LayerNormBackwardArgs& a, int blocks) {
  constexpr const char* kWho = "opfuse layer_norm_backward";
  if (a.dtype < 0 || a.dtype > 2)
    return failure("%s: dtype %d; accepted: 0 (float32), 1 (bfloat16), 2 (float16)", kWho, a.dtype);
  if (a.tokens < 0 || a.hidden <= 0)
    return failure("%s: tokens %lld, hidden %lld; need tokens >= 0 and hidden > 0", kWho,
                   static_cast<long long>(a.tokens), static_cast<long long>(a.hidden));
  if (blocks < 1) return failure("%s: blocks %d; need >= 1", kWho, blocks);
  if (a.tokens > 0 && (!a.dy || !a.h || !a.dh)) return failure("%s: dy, h and dh are required (%lld tokens)", kWho,
                                                               static_cast<long long>(a.tokens));
  if ((a.dw || a.db) && !a.partial)
    return failure("%s: partial ([2, %d, %lld] float32) is required with dw or db", kWho, blocks,
                   static_cast<long long>(a.hidden));
  const int elem = dtype_size(a.dtype);
  const void* ptrs[] = {a.dy, a.h, a.weight, a.dh_out, a.dh, a.dw, a.db};
  const char* names[] = {"dy", "h", "weight", "dh_out", "dh", "dw", "db"};
  for (int i = 0; i < 7; ++i)
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % elem)
      return failure("%s: %s at address 0x%llx is not aligned to its %d-byte elements", kWho, names[i],
                     static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(ptrs[i])), elem);
  if (reinterpret_cast<uintptr_t>(a.partial) % sizeof(float))
    return failure("%s: partial at address 0x%llx is not 4-byte aligned", kWho,
                   static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(a.partial)));
  return nullptr;
}

// Whether the vectorised kernel can take the rows: whole 16-byte packs, 16-byte aligned
// addresses, and few enough packs per thread for registers.
bool layer_backward_fits_packs(const LayerNormBackwardArgs& a) {
  if ((a.hidden * dtype_size(a.dtype)) % kPackBytes) return false;
  if (row_layout(a.hidden, a.dtype).vpt > kMaxVpt) return false;
  const void* ptrs[] = {a.dy, a.h, a.weight, a.dh_out, a.dh};
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % kPackBytes) return false;
  return true;
}

}  // namespace

const char* add_norm(const ResidualNormArgs& args, int max_blocks, cudaStream_t stream) {
  if (const char* bad = check_residual_norm_args(args)) return bad;
  if (args.tokens == 0) return nullptr;
  const RowLayout layout = row_layout(args.hidden, args.dtype);
  const int blocks = static_cast<int>(args.tokens < max_blocks ? args.tokens : max_blocks);
  return dispatch_row_kernel<QuantMode::kNone, QuantMode::kTensor>(
      args.dtype, layout.vpt, args.quant, [&]<typename T, int VPT, QuantMode Q>() -> const char* {
    add_norm_kernel<T, VPT, Q><<<blocks, layout.threads, 0, stream>>>(args);
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
    if (args.weight)
      return launch_sum_partials<T>(args.dw_partial, blocks, args.hidden, static_cast<T*>(args.dw), nullptr, stream);
    return nullptr;
  });
}

const char* layer_norm_backward(const LayerNormBackwardArgs& args, int blocks, cudaStream_t stream) {
  if (const char* bad = check_layer_backward_args(args, blocks)) return bad;
  if (args.tokens == 0) {  // no rows: the parameter gradients are zero (all-zero bits in every dtype)
    for (void* out : {args.dw, args.db}) {
      if (!out) continue;
      const cudaError_t status = cudaMemsetAsync(out, 0, args.hidden * dtype_size(args.dtype), stream);
      if (status != cudaSuccess) return failure("opfuse layer_norm_backward: cudaMemsetAsync: %s",
                                                cudaGetErrorString(status));
    }
    return nullptr;
  }
  const bool packs = layer_backward_fits_packs(args);
  const RowLayout layout = row_layout(args.hidden, args.dtype);
  const int vpt = packs ? layout.vpt : 1;
  // The partial rows are only written when a parameter gradient is asked for.
  LayerNormBackwardArgs launch = args;
  if (!args.dw && !args.db) launch.partial = nullptr;
  return dispatch_row_kernel(args.dtype, vpt, [&]<typename T, int VPT>() -> const char* {
    if (packs) {
      layer_backward_kernel<T, VPT><<<blocks, layout.threads, 0, stream>>>(launch);
    } else {
      const int64_t warps = (args.hidden + 31) / 32;
      const int threads = static_cast<int>(warps * 32 < kMaxThreads ? warps * 32 : kMaxThreads);
      layer_backward_scalar_kernel<T><<<blocks, threads, 0, stream>>>(launch);
    }
    if (const char* err = launch_status()) return failure("opfuse layer_norm_backward: %s", err);
    if (!launch.partial) return nullptr;
    const char* err = launch_sum_partials<T>(launch.partial, blocks, args.hidden, static_cast<T*>(args.dw),
                                             static_cast<T*>(args.db), stream);
    return err ? failure("opfuse layer_norm_backward: summing partials: %s", err) : nullptr;
  });
}

}  // namespace opfuse
