// Row-level building blocks shared by every residual-norm kernel: the thread layout of one row,
// the bias + residual + norm epilogue, argument checks and the dtype/VPT dispatch.
//
// A block works on one row (or one part of a row: WholeRow, ClusterRow) at a time. Thread t owns the 16-byte
// packs first + t, first + t + blockDim.x, ... (VPT of them), so a row lives in registers between
// the reduction and the normalisation.
#pragma once

#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <cstdio>
#include <utility>

#include "common.cuh"
#include "residual_norm.h"

namespace opfuse {

template <typename T, int VPT>
struct RowRegs {
  static constexpr int kElems = Pack<T>::kElems;
  float v[VPT][kElems];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < VPT; ++j)
#pragma unroll
      for (int e = 0; e < kElems; ++e) v[j][e] = 0.f;
  }

  __device__ __forceinline__ void add(int j, const uint4& raw) {
    Pack<T> p;
    p.raw = raw;
#pragma unroll
    for (int e = 0; e < kElems; ++e) v[j][e] += Elem<T>::to_float(p.elems[e]);
  }

  // Pack j becomes the values of ``raw`` (what a peer that received ``raw`` holds).
  __device__ __forceinline__ void set(int j, const uint4& raw) {
    Pack<T> p;
    p.raw = raw;
#pragma unroll
    for (int e = 0; e < kElems; ++e) v[j][e] = Elem<T>::to_float(p.elems[e]);
  }

  // Round every value to T (what storing and re-loading would give) and return the packed form.
  __device__ __forceinline__ uint4 round(int j) {
    Pack<T> p;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      p.elems[e] = Elem<T>::from_float(v[j][e]);
      v[j][e] = Elem<T>::to_float(p.elems[e]);
    }
    return p.raw;
  }
};

// --- Phase timeline (bench/allreduce_timeline.py) ---------------------------------------------
// With PeerRegion::timeline set, thread 0 of every block stores %globaltimer at the kernel's phase
// boundaries into timeline[((calls % kTimelineCalls) * kCallSlots + block) * kTimelinePhases +
// phase]; a null timeline (every production launch) costs one uniform branch per phase.
// (kTimelineCalls, kTimelinePhases: residual_norm.h.)

// The timer read after ``dep`` is available (its load has completed), so a stamp taken after a
// wait marks the data's arrival, not the load's issue.
__device__ __forceinline__ uint64_t timer_after(uint32_t dep) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(dep) : "memory");
  return t;
}

__device__ __forceinline__ void stamp(uint64_t* timeline, uint32_t calls, int phase, uint64_t ns) {
  if (timeline != nullptr && threadIdx.x == 0)
    timeline[((calls % kTimelineCalls) * kCallSlots + blockIdx.x) * kTimelinePhases + phase] = ns;
}

// Where finish_row stamps its own steps (the one-shot passes these for its first row): after the
// residual add and the h stores (``summed``), after the norm's block reduction (``reduced``).
struct RowStamps {
  uint64_t* timeline = nullptr;
  uint32_t calls = 0;
  int summed = 0;
  int reduced = 0;

  __device__ __forceinline__ void at(int phase, float dep) const {
    if (timeline != nullptr) stamp(timeline, calls, phase, timer_after(__float_as_uint(dep)));
  }
};

// --- Row parts ---------------------------------------------------------------------------------
// The packs [first, first + count) of a row that one block handles, and how its partial reductions
// (the norm's sums, the FP8 amax) become the row's. Both kinds keep every block's result bitwise
// equal to every other's, and to every rank's (ranks split rows the same way).

// A block owns whole rows: block reductions.
struct WholeRow {
  int first = 0;
  int count = 0;  // the row's packs

  __device__ __forceinline__ float sum(float v, float* scratch) { return block_sum(v, scratch); }
  __device__ __forceinline__ float max(float v, float* scratch) { return block_max(v, scratch); }
  // The thread that writes a row's scalar outputs (FP8 scales).
  __device__ __forceinline__ bool leader() const { return threadIdx.x == 0; }
};

// Blocks a ClusterRow may split a row over (the portable cluster size).
constexpr int kMaxClusterRow = 8;

// Packs of each part of a row of ``nvec`` packs split over ``split`` blocks (the last part may be
// shorter); the host's launch and the kernel's parts use this one formula.
__host__ __device__ __forceinline__ int part_span(int nvec, int split) { return (nvec + split - 1) / split; }

// Warps per block of a split row (512 threads).
constexpr int kMaxClusterRowWarps = 16;

struct ClusterRowShared {
  float totals[2][kMaxClusterRow * kMaxClusterRowWarps];  // [slot][sender block's rank x warps + warp]
  uint64_t arrived[2];                                    // mbarrier per slot
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The address of shared variable ``local`` (a shared::cta address) in block ``rank`` of the cluster.
__device__ __forceinline__ uint32_t cluster_address(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

// A row split over the blocks of a thread-block cluster (sm_90): block rank r of the cluster
// handles [r * span, (r + 1) * span) (span: part_span). Moving a whole row (the received packs, the operands, h and
// y: ~6 x the row's bytes) through one SM bounds a small call's epilogue; split k ways, each SM
// moves 1/k of it.
//
// A reduction sends every warp's total into every block's shared memory (st.async, which signals
// the receiver's mbarrier with its bytes); each block then reduces the blocks x warps totals in one
// fixed order, so every block gets the same bits. Neither a block nor a cluster barrier per
// reduction: a cluster barrier's release would wait for every global store the block has issued
// (its pushes to the peers, h, the sentinels: measured ~1.7 us on simulated ranks), which is what
// the split is meant to take off the row's path. Reductions alternate between two slots and
// mbarriers. A block sends reduction n + 2 into a slot only after it completed n + 1, which needed
// every block's n + 1 totals, sent after that block had read the slot's reduction n; so a slot is
// never overwritten while unread, and an mbarrier never sees a phase's bytes before its previous
// phase completed. No block exits before it has received the last reduction's totals, so nothing
// is sent to a block that has exited.
struct ClusterRow {
  int first = 0;
  int count = 0;
  ClusterRowShared* shared = nullptr;
  uint32_t blocks = 1;  // in the cluster
  uint32_t rank = 0;    // this block's
  uint32_t reductions = 0;

  // Every thread of every block of the cluster, before the first reduction: the mbarriers are
  // initialised, then one relaxed cluster barrier (no global memory is ordered by it, so it costs
  // the same wherever it runs; it may precede pdl_wait) publishes them to the other blocks.
  __device__ __forceinline__ void init(ClusterRowShared* s) {
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    shared = s;
    blocks = cluster.num_blocks();
    rank = cluster.block_rank();
    if (threadIdx.x == 0) {
      for (int slot = 0; slot < 2; ++slot)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&s->arrived[slot])) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
  }

  // The row's sum (or max) of every thread's ``v`` over the cluster: each warp reduces its own,
  // then lanes 0..blocks-1 send the warp's total to every block, and every warp of every block
  // reduces the blocks x warps totals in the same order (lane i takes totals i, i + 32, ...; then
  // the butterfly, which gives every lane the same bits). No block barrier at all.
  __device__ __forceinline__ float combine(float v, bool take_max) {
    const int slot = reductions & 1;
    const uint32_t parity = (reductions >> 1) & 1;
    ++reductions;
    const uint32_t warps = (blockDim.x + 31) / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t senders = blocks * warps;  // totals every block receives
    const uint32_t arrived = shared_address(&shared->arrived[slot]);
    v = take_max ? warp_max(v) : warp_sum(v);
    if (threadIdx.x == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(arrived), "r"(senders * 4u)
                   : "memory");
    if (lane < blocks) {  // lane r sends this warp's total to block r
      const uint32_t mine = shared_address(&shared->totals[slot][rank * warps + warp]);
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                       cluster_address(mine, lane)),
                   "r"(__float_as_uint(v)), "r"(cluster_address(arrived, lane))
                   : "memory");
    }
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(arrived), "r"(parity)
          : "memory");
    float total = 0.f;
    for (uint32_t i = lane; i < senders; i += 32) {
      const float t = shared->totals[slot][i];
      total = take_max ? fmaxf(total, t) : total + t;
    }
    return take_max ? warp_max(total) : warp_sum(total);
  }
  __device__ __forceinline__ float sum(float v, float*) { return combine(v, false); }
  __device__ __forceinline__ float max(float v, float*) { return combine(v, true); }
  __device__ __forceinline__ bool leader() const { return threadIdx.x == 0 && rank == 0; }
};

// The epilogue's per-row operands, loaded into registers ahead of finish_row: a kernel that
// waits for peers loads them before its wait, so their latency overlaps it instead of following
// it. Costs 4 x VPT x 16 B of registers per thread; absent operands (null pointers) stay zero.
template <typename T, int VPT>
struct HeldOperands {
  enum : int { kBias = 0, kResidual = 1, kWeight = 2, kNormBias = 3 };
  uint4 pack[4][VPT];

  // The operands of packs [first, first + count) of row ``row`` (``nvec`` packs per row).
  __device__ __forceinline__ void load(int64_t row, const ResidualNormArgs& a, int nvec, int first, int count) {
    const uint4* src[4] = {static_cast<const uint4*>(a.bias),
                           a.residual ? static_cast<const uint4*>(a.residual) + row * nvec : nullptr,
                           static_cast<const uint4*>(a.weight), static_cast<const uint4*>(a.norm_bias)};
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int local = j * blockDim.x + threadIdx.x;
        pack[k][j] = src[k] && local < count ? __ldg(src[k] + first + local) : make_uint4(0u, 0u, 0u, 0u);
      }
  }
};

// FP8 of one value (round to nearest even; NaN-free input assumed: the clamp maps NaN to -max).
__device__ __forceinline__ uint32_t to_fp8(float v, float fp8_max, int format) {
  v = fminf(fmaxf(v, -fp8_max), fp8_max);
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE,
                               format == static_cast<int>(Fp8Format::kE5M2) ? __NV_E5M2 : __NV_E4M3);
}

// The FP8 epilogue (QuantMode Q != kNone) of a row whose normalised values, rounded to T, are in
// ``regs``. The scale math is opfuse/fp8/numerics.py's in float32 with IEEE divisions, so the
// bytes equal the reference quantizer's for the same y. Contains barriers (block_max).
template <typename T, int VPT, QuantMode Q, typename Part>
__device__ __forceinline__ void quantize_row(const RowRegs<T, VPT>& regs, int64_t row, const ResidualNormArgs& a,
                                             float* scratch, Part& part) {
  constexpr int E = Pack<T>::kElems;  // FP8 bytes per pack: 8 (16-bit T) or 4 (float32)
  float amax;
  if constexpr (Q == QuantMode::kTensor) {
    amax = __ldg(a.amax);
  } else {
    float local = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      if (j * blockDim.x + threadIdx.x < part.count) {
#pragma unroll
        for (int e = 0; e < E; ++e) local = fmaxf(local, fabsf(regs.v[j][e]));
      }
    }
    amax = part.max(local, scratch);
    if constexpr (Q == QuantMode::kRowAmax) {
      if (part.leader()) a.scales[row] = amax;
      return;
    }
  }
  const float fp8_max = a.fp8 == static_cast<int>(Fp8Format::kE5M2) ? 57344.f : 448.f;
  const float scale = amax > 0.f ? __fdiv_rn(fp8_max, amax) : 1.f;
  if (part.leader() && (Q == QuantMode::kRowwise || row == 0))
    a.scales[Q == QuantMode::kRowwise ? row : 0] = __fdiv_rn(1.f, scale);
  uint8_t* q_row = static_cast<uint8_t*>(a.q) + row * a.hidden;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int local = j * blockDim.x + threadIdx.x;
    if (local < part.count) {
      const int idx = part.first + local;
      uint32_t word[E / 4] = {};
#pragma unroll
      for (int e = 0; e < E; ++e)
        word[e / 4] |= to_fp8(__fmul_rn(regs.v[j][e], scale), fp8_max, a.fp8) << (8 * (e % 4));
      if constexpr (E == 8) {
        reinterpret_cast<uint2*>(q_row)[idx] = make_uint2(word[0], word[1]);
      } else {
        reinterpret_cast<uint32_t*>(q_row)[idx] = word[0];
      }
    }
  }
}

// h = T(sum + bias + residual) (written when args.h is set); y = norm(h) or h, then the FP8
// epilogue ``Q`` (QuantMode, residual_norm.h).
// ``regs`` holds the reduced sum of ``part`` of row ``row`` (a WholeRow or ClusterRow; zero in
// packs past its end; ``nvec`` packs per row). The bias, residual and norm weight/bias come from
// ``held`` when given (loaded for this part), otherwise from global memory where they are used.
// Every thread of the block (and of its cluster, for a ClusterRow) must call this (it contains
// barriers).
template <typename T, int VPT, QuantMode Q = QuantMode::kNone, typename Part = WholeRow>
__device__ __forceinline__ void finish_row(RowRegs<T, VPT>& regs, int64_t row, const ResidualNormArgs& a, int nvec,
                                           float* scratch, Part& part, const HeldOperands<T, VPT>* held = nullptr,
                                           const RowStamps& stamps = RowStamps{}) {
  using Held = HeldOperands<T, VPT>;
  constexpr int E = Pack<T>::kElems;
  const uint4* bias = static_cast<const uint4*>(a.bias);
  const uint4* res = a.residual ? static_cast<const uint4*>(a.residual) + row * nvec : nullptr;
  uint4* h_out = a.h ? static_cast<uint4*>(a.h) + row * nvec : nullptr;
  uint4* y_out = Q == QuantMode::kNone ? static_cast<uint4*>(a.y) + row * nvec : nullptr;
  float local_sum = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int local = j * blockDim.x + threadIdx.x;
    if (local < part.count) {
      const int idx = part.first + local;
      if (bias) regs.add(j, held ? held->pack[Held::kBias][j] : __ldg(bias + idx));
      if (res) regs.add(j, held ? held->pack[Held::kResidual][j] : __ldg(res + idx));
      const uint4 packed = regs.round(j);
      if (h_out) h_out[idx] = packed;
      if (Q == QuantMode::kNone && a.norm == static_cast<int>(NormKind::kNone)) y_out[idx] = packed;
#pragma unroll
      for (int e = 0; e < E; ++e) local_sum += regs.v[j][e];
    }
  }
  stamps.at(stamps.summed, local_sum);
  if (a.norm == static_cast<int>(NormKind::kNone)) return;  // uniform branch: no barrier skipped unevenly

  const float inv_h = 1.f / static_cast<float>(a.hidden);
  float mean = 0.f, sq = 0.f;
  if (a.norm == static_cast<int>(NormKind::kLayer)) {
    mean = part.sum(local_sum, scratch) * inv_h;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      if (j * blockDim.x + threadIdx.x < part.count) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float d = regs.v[j][e] - mean;
          sq += d * d;
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      if (j * blockDim.x + threadIdx.x < part.count) {
#pragma unroll
        for (int e = 0; e < E; ++e) sq += regs.v[j][e] * regs.v[j][e];
      }
    }
  }
  const float rstd = rsqrtf(part.sum(sq, scratch) * inv_h + a.eps);
  stamps.at(stamps.reduced, rstd);
  const uint4* weight = static_cast<const uint4*>(a.weight);
  const uint4* nbias = static_cast<const uint4*>(a.norm_bias);
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int local = j * blockDim.x + threadIdx.x;
    if (local < part.count) {
      const int idx = part.first + local;
      Pack<T> w, b, out;
      if (weight) w.raw = held ? held->pack[Held::kWeight][j] : __ldg(weight + idx);
      if (nbias) b.raw = held ? held->pack[Held::kNormBias][j] : __ldg(nbias + idx);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float val = (regs.v[j][e] - mean) * rstd;
        if (weight) val *= Elem<T>::to_float(w.elems[e]);
        if (nbias) val += Elem<T>::to_float(b.elems[e]);
        out.elems[e] = Elem<T>::from_float(val);
        if constexpr (Q != QuantMode::kNone) regs.v[j][e] = Elem<T>::to_float(out.elems[e]);  // y as T
      }
      if constexpr (Q == QuantMode::kNone) y_out[idx] = out.raw;
    }
  }
  if constexpr (Q != QuantMode::kNone) quantize_row<T, VPT, Q>(regs, row, a, scratch, part);
}

// The flag-based two-shot's call counter (state[0]) as this call's blocks see it; every thread that uses it reads it
// here, once, at its start. The acquire orders the read before everything the thread does later,
// in particular (through publish_call's barrier) before its block's increment of the finished-
// blocks counter, so no block can read the value the last block publishes.
__device__ __forceinline__ uint32_t read_call_state(const uint32_t* state) { return ld_acquire_gpu(state); }

// The last block of a call to finish stores ``next`` into state[0] (the counter every block read
// with read_call_state) and resets the finished-blocks counter state[1]. ``on_last`` runs in the
// last block's thread 0 before the publish.
//
// No fence before the increment: nothing the other blocks wrote is read in this kernel after it.
// The counter only elects the last block; the state it writes is read by the next launch on this
// stream, after the kernel boundary; peers never read it (they read their receive buffers, where
// the data itself is the flag, and the buffer rotation is ordered by stream order plus the
// arrival of this rank's next call's data). A fence here would only
// make every block wait for its remote stores to be acknowledged before it retires. The fence
// before the publish pairs with read_call_state's acquire: if a block could read ``next``, the
// last block's increment would be ordered before that block's own earlier increment.
template <typename OnLast>
__device__ __forceinline__ void publish_call(uint32_t* state, uint32_t next, OnLast&& on_last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t done = atomicAdd(state + 1, 1u);
    if (done == gridDim.x - 1) {
      state[1] = 0;
      on_last();
      __threadfence();
      atomicExch(state, next);
    }
  }
}

// --- Per-block call state (one-shot, Lamport two-shot) -------------------------------------
// The Lamport kernels need, per call, only the number of calls this rank completed on the region
// (which receive buffer is current). It lives in kCallSlots 4-byte slots at the region's start,
// one per block index: block b reads slot b when it starts and, when it is done, writes the next
// count into every slot s = b (mod gridDim.x). So every slot is current whatever grid the next call
// launches with, and a call needs no atomic, no fence and no election of a last block: the previous
// design's end-of-call publish (an atomic per block, then the last block's fence, which waited for
// that block's remote stores) sat on the critical path of every small call. The next launch on the
// stream reads the slots after the kernel boundary (or pdl_wait). Grids are capped at kCallSlots.
constexpr int64_t kCallStateBytes = kCallSlots * 4;  // kCallSlots: residual_norm.h

struct CallState {
  uint32_t calls;  // calls this rank completed on the region
};

__device__ __forceinline__ CallState read_call_slot(const void* state) {
  uint32_t calls;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];"
               : "=r"(calls)
               : "l"(static_cast<const uint32_t*>(state) + blockIdx.x)
               : "memory");
  return {calls};
}

// Every thread of the block must call this, after its last use of the slot it read.
__device__ __forceinline__ void write_call_slots(void* state, uint32_t next_calls) {
  __syncthreads();  // slot blockIdx.x is overwritten only after every thread of the block read it
  uint32_t* slots = static_cast<uint32_t*>(state);
  for (int s = blockIdx.x + threadIdx.x * gridDim.x; s < kCallSlots; s += blockDim.x * gridDim.x)
    slots[s] = next_calls;
}

// --- Programmatic dependent launch (PDL) -----------------------------------------------------
// A kernel launched with programmatic stream serialization (launch_kernel(..., pdl = true)) may
// start while the kernel before it on the stream is still running. Everything up to pdl_wait()
// overlaps that kernel's tail, so nothing before it may read memory a previous kernel writes (the
// inputs, the parameters, the region's state): the peer kernels call it first. pdl_wait() returns
// once every prerequisite grid has completed and its memory is visible; without PDL it returns at
// once. pdl_launch_dependents() lets the next PDL kernel on the stream be scheduled: called right
// after pdl_wait(), so at most two grids of a stream are resident (this one, running, and the next,
// waiting in its pdl_wait); this grid is then fully resident (every block has run the trigger), so
// blocks of the next grid never take SMs this grid still needs.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// --- Host side ------------------------------------------------------------------------------

inline int dtype_size(int dtype) { return dtype == static_cast<int>(DType::kFloat32) ? 4 : 2; }

// Threads per block and packs per thread for a row of ``hidden`` elements.
struct RowLayout {
  int threads = 0;
  int vpt = 0;   // packs per thread actually needed
  int nvec = 0;  // packs per row
};

inline RowLayout row_layout(int64_t hidden, int dtype) {
  RowLayout layout;
  const int elems = kPackBytes / dtype_size(dtype);
  layout.nvec = static_cast<int>(hidden / elems);
  int threads = ((layout.nvec + 31) / 32) * 32;
  layout.threads = threads > kMaxThreads ? kMaxThreads : threads;
  layout.vpt = (layout.nvec + layout.threads - 1) / layout.threads;
  return layout;
}

constexpr int kMaxVpt = 8;

inline const char* check_residual_norm_args(const ResidualNormArgs& a) {
  if (a.dtype < 0 || a.dtype > 2) return "opfuse kernel: dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)";
  if (a.norm < 0 || a.norm > 2) return "opfuse kernel: norm must be 0 (none), 1 (rms) or 2 (layer)";
  if (a.tokens < 0 || a.hidden <= 0) return "opfuse kernel: tokens must be >= 0 and hidden > 0";
  if ((a.hidden * dtype_size(a.dtype)) % kPackBytes) return "opfuse kernel: hidden * element size must be a multiple of 16 bytes";
  if (row_layout(a.hidden, a.dtype).vpt > kMaxVpt) return "opfuse kernel: hidden too large (max 65536 for 16-bit, 32768 for float32)";
  if (a.quant < 0 || a.quant > 3) return "opfuse kernel: quant must be 0 (none), 1 (rowwise), 2 (row amax) or 3 (tensor)";
  if (a.quant == static_cast<int>(QuantMode::kNone)) {
    if (!a.x || !a.y) return "opfuse kernel: x and y are required";
  } else {
    if (!a.x) return "opfuse kernel: x is required";
    if (a.norm == static_cast<int>(NormKind::kNone)) return "opfuse kernel: the FP8 epilogue needs a norm (rms or layer)";
    if (a.fp8 != 0 && a.fp8 != 1) return "opfuse kernel: fp8 must be 0 (e4m3) or 1 (e5m2)";
    if (!a.scales) return "opfuse kernel: the FP8 epilogue needs scales";
    if (a.quant == static_cast<int>(QuantMode::kRowAmax) && !a.h)
      return "opfuse kernel: the row-amax pass must write h (the second pass reads it)";
    if (a.quant != static_cast<int>(QuantMode::kRowAmax) && !a.q) return "opfuse kernel: the FP8 epilogue needs q";
    if (a.quant == static_cast<int>(QuantMode::kTensor) && !a.amax) return "opfuse kernel: tensor scaling needs amax";
  }
  const void* ptrs[] = {a.x, a.bias, a.residual, a.weight, a.norm_bias, a.y, a.h, a.q};
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % kPackBytes) return "opfuse kernel: every pointer must be 16-byte aligned";
  return nullptr;
}

inline const char* launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Launches ``kernel<<<grid, threads, 0, stream>>>(args...)`` in clusters of ``cluster`` blocks
// (1: no clusters; grid a multiple of it), with programmatic stream serialization when ``pdl``
// (the kernel must call pdl_wait() before touching memory that earlier work writes). Returns
// nullptr or the CUDA error.
template <typename... Params, typename... Args>
const char* launch_cluster_kernel(void (*kernel)(Params...), int grid, int threads, int cluster, cudaStream_t stream,
                                  bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  unsigned count = 0;
  if (pdl) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count++].val.clusterDim = {static_cast<unsigned>(cluster), 1u, 1u};
  }
  config.attrs = count ? attributes : nullptr;
  config.numAttrs = count;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the launch error, as a failed <<<>>> launch would be cleared by launch_status
    return cudaGetErrorString(err);
  }
  return launch_status();
}

// launch_cluster_kernel without clusters.
template <typename... Params, typename... Args>
const char* launch_kernel(void (*kernel)(Params...), int grid, int threads, cudaStream_t stream, bool pdl,
                          Args&&... args) {
  return launch_cluster_kernel(kernel, grid, threads, 1, stream, pdl, std::forward<Args>(args)...);
}

// Calls ``fn.template operator()<T, VPT>()`` for the runtime dtype and the smallest VPT >= vpt.
template <typename Fn>
const char* dispatch_row_kernel(int dtype, int vpt, Fn&& fn) {
  auto by_vpt = [&](auto tag) -> const char* {
    using T = decltype(tag);
    if (vpt <= 1) return fn.template operator()<T, 1>();
    if (vpt <= 2) return fn.template operator()<T, 2>();
    if (vpt <= 4) return fn.template operator()<T, 4>();
    return fn.template operator()<T, 8>();
  };
  switch (dtype) {
    case 0: return by_vpt(float{});
    case 1: return by_vpt(__nv_bfloat16{});
    default: return by_vpt(__half{});
  }
}

// dispatch_row_kernel for kernels with FP8 epilogues: calls
// ``fn.template operator()<T, VPT, Q>()`` for the runtime ``quant`` among ``Modes`` (the
// epilogues the kernel is compiled with).
template <QuantMode... Modes, typename Fn>
const char* dispatch_row_kernel(int dtype, int vpt, int quant, Fn&& fn) {
  return dispatch_row_kernel(dtype, vpt, [&]<typename T, int VPT>() -> const char* {
    const char* result = "opfuse kernel: this kernel is not compiled with the requested FP8 epilogue (quant)";
    ((quant == static_cast<int>(Modes) ? (result = fn.template operator()<T, VPT, Modes>(), true) : false) || ...);
    return result;
  });
}

// The epilogues of the peer-memory all-reduce kernels.
template <typename Fn>
const char* dispatch_peer_row_kernel(int dtype, int vpt, int quant, Fn&& fn) {
  return dispatch_row_kernel<QuantMode::kNone, QuantMode::kRowwise, QuantMode::kRowAmax>(dtype, vpt, quant, fn);
}

}  // namespace opfuse
