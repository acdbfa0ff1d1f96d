// Shared device helpers for opfuse kernels: 16-byte packs of bf16/fp16/fp32, the -0.0 sentinel
// used by the Lamport protocol, memory-model-aware loads/stores, bounded waits on peers, and block
// reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dtype.h"
#include "peer_wait.h"

namespace opfuse {

constexpr int kPackBytes = 16;
constexpr int kMaxThreads = 1024;

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};

template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Elem<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

// A 16-byte pack of T: the unit every kernel moves.
template <typename T>
union Pack {
  static constexpr int kElems = kPackBytes / sizeof(T);
  uint4 raw;
  uint32_t words[4];
  T elems[kElems];
};

// --- The Lamport sentinel -------------------------------------------------------------------
// Receive buffers hold -0.0 in every element until a peer's value lands. Senders turn a real
// -0.0 into +0.0 (which sums identically), so "no element equals -0.0" means "all arrived".

template <typename T>
__device__ __forceinline__ uint4 sentinel_pack() {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(0x80000000u, 0x80000000u, 0x80000000u, 0x80000000u);
  } else {
    return make_uint4(0x80008000u, 0x80008000u, 0x80008000u, 0x80008000u);
  }
}

template <typename T>
__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      any |= (w[i] == 0x80000000u);
    } else {
      any |= ((w[i] & 0xFFFFu) == 0x8000u) | ((w[i] >> 16) == 0x8000u);
    }
  }
  return any;
}

template <typename T>
__device__ __forceinline__ uint4 clear_negative_zero(uint4 v) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      if (w[i] == 0x80000000u) w[i] = 0u;
    } else {
      if ((w[i] & 0xFFFFu) == 0x8000u) w[i] &= 0xFFFF0000u;
      if ((w[i] >> 16) == 0x8000u) w[i] &= 0x0000FFFFu;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// --- Loads and stores -------------------------------------------------------------------------

__device__ __forceinline__ uint4 ld_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile(uint4* p, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Read through L2 only: data that peers wrote into our memory must not come from a stale L1 line.
__device__ __forceinline__ uint4 ld_l2(const uint4* p) { return __ldcg(p); }

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// --- Bounded waits on peers (peer_wait.h) ---------------------------------------------------

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Call every ~1k polls of a spin on ``peer``; ``start`` is 0 on the first call (the clock starts
// then, so a wait that succeeds at once never reads the timer). True when the wait must stop: it
// exceeded the timeout (recorded for the host), or another wait already gave up (the call's data
// is incomplete anyway; spinning on would only delay the error).
__device__ __forceinline__ bool peer_wait_expired(const PeerWait& w, uint64_t& start, PeerWaitSite site, int rank,
                                                  int peer) {
  if (w.flag == nullptr) return false;
  if (*reinterpret_cast<volatile uint32_t*>(w.flag) != 0u) return true;
  const uint64_t now = global_timer_ns();
  if (start == 0) {
    start = now;
    return false;
  }
  if (w.timeout_ns == 0 || now - start < w.timeout_ns) return false;
  if (atomicCAS(w.flag, 0u, 1u) == 0u) {
    volatile PeerWaitRecord* r = w.record;
    r->site = static_cast<int32_t>(site);
    r->rank = rank;
    r->peer = peer;
    r->op = w.op;
    r->block = static_cast<int32_t>(blockIdx.x);
    r->waited_ns = now - start;
    __threadfence_system();
    r->failed = 1;
    __threadfence_system();
  }
  return true;
}

// --- Block reductions -------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Two sums at once (the RMSNorm backward reduces sum(h * h) and sum(g * h) together).
__device__ __forceinline__ float2 warp_sum(float2 v) {
  return make_float2(warp_sum(v.x), warp_sum(v.y));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduce ``v`` over the block with ``warp_reduce`` (a warp-wide reduction; lanes past the last
// warp contribute ``V{}``, the identity of the sums and of a max of non-negative values); every
// thread gets the result. ``scratch`` holds >= 33 values; the function ends with a barrier so
// scratch can be reused immediately.
template <typename V, typename WarpReduce>
__device__ __forceinline__ V block_reduce(V v, V* scratch, WarpReduce warp_reduce) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_reduce(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    V t = lane < warps ? scratch[lane] : V{};
    t = warp_reduce(t);
    if (lane == 0) scratch[32] = t;
  }
  __syncthreads();
  const V total = scratch[32];
  __syncthreads();
  return total;
}

// Sum over the block of ``V`` = float or float2 (block_reduce).
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
  return block_reduce(v, scratch, [](V x) { return warp_sum(x); });
}

// Max over the block of non-negative floats (block_reduce).
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce(v, scratch, [](float x) { return warp_max(x); });
}

}  // namespace opfuse
