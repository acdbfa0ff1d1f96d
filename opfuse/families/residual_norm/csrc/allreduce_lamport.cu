// Pipelined two-shot all-reduce (+ bias + residual + norm) for large messages, with Lamport receive
// buffers: no flags, no fences, no barrier between ranks. The data is the flag.
//
// Rows are split into W chunks of R = ceil(T / W) rows; rank o owns rows [o R, o R + R). Block b of
// every rank works on the chunk rows i = b, b + G, b + 2G, ... (G = gridDim.x, the same on every
// rank) in steps n = 0, 1, ...; in its step s a block
//
//   push(s):            sends row i_s of every other owner's chunk of x to that owner (16-byte
//                       stores into the owner's reduce-scatter slot for this rank, -0.0 flushed);
//   reduce(s - 1):      waits until the W - 1 partial rows of its own row i_{s-1} have arrived
//                       (no element holds the -0.0 sentinel), sums them with its own in rank order
//                       in float32, rounds to the dtype, sends the sums to every other rank's
//                       all-gather slot, writes the sentinel back into the slots it read, and
//                       finishes the row (bias + residual + norm, h and y) from the rounded sums;
//   finish(s - 2):      waits for the W - 1 other owners' sums of row i_{s-2}, writes the sentinel
//                       back, and finishes those rows the same way.
//
// So a block's NVLink stores (push, the sums) are issued while the rows they depend on are still in
// flight, and nothing ever waits for a store to be acknowledged: the per-stage fence + flag round
// trips of the flag-based two-shot (allreduce_twoshot.cu) are gone, and the link sees a steady
// stream of 16-byte stores from every SM. Each rank sends 2 (W - 1) / W of the message, the minimum
// without multicast. All ranks finish every row from the same rounded sums (the owner's rounded
// and -0.0-flushed values are exactly what the others receive), with the same code and block size,
// so outputs are bitwise identical across ranks. Numerics are the flag-based two-shot's: float32
// rank-order sum rounded once to the dtype, then bias and residual added in float32 and h rounded.
//
// Buffers. Two, used by alternate calls (call k uses buffer k % 2). Every pack a peer writes in a
// call is read by its owner in the same call and written back to the sentinel right after it was
// read, so between calls both buffers hold nothing but sentinels, whatever the sizes of earlier
// calls were (no clear pass, no record of dirty sizes). A peer writes buffer k % 2 again at call
// k + 2; it reaches call k + 2 only after its call k + 1 received this rank's call-k+1 data, which
// this rank sends only after its call k finished (stream order, or pdl_wait with PDL), clearing
// included. A peer in call k + 1 writes the other buffer, which this rank finished reading in call
// k - 1. (A peer that timed out is the exception; the host then refuses further calls.)
//
// Deadlock freedom: block b only ever waits for data sent by block b of the other ranks, at an
// earlier or the same step of the same pipeline, so chains of different blocks never wait for each
// other and the grid needs no co-residency on one GPU.
//
// Region layout (bytes): [0, kCallStateBytes) the per-block call slots (row.cuh: completed calls,
// whose parity picks the buffer); then buffer 0 and buffer 1, each a reduce-scatter area and an all-gather area of
// area_bytes. In owner o's reduce-scatter area, slot k (k = 0 .. W-2) holds the partial rows of
// source (o + 1 + k) % W (R rows each); in receiver d's all-gather area, slot k holds the rounded
// sums of owner (d + 1 + k) % W.

#include "row.cuh"

namespace opfuse {
namespace {

constexpr int64_t kStateBytes = kCallStateBytes;
constexpr int64_t kMaxRowBytes = 65536LL * 2;  // rows up to 128 KiB (bf16 hidden 65536)
// The residual row is requested into L2 (a prefetch, no registers) before a row's wait, and read
// by finish_row after it. Holding it and the other operands in registers (the one-shot's
// HeldOperands) spilled here at 1024 threads x 64 registers (ptxas: 72-80 bytes at VPT 1); the
// bias and norm weight are the same for every row and stay in L1/L2 anyway.
template <int VPT>
__device__ __forceinline__ void prefetch_residual(const ResidualNormArgs& a, int64_t row, int nvec) {
  if (a.residual == nullptr) return;
  const uint4* res = static_cast<const uint4*>(a.residual) + row * nvec;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int idx = j * blockDim.x + threadIdx.x;
    if (idx < nvec) asm volatile("prefetch.global.L2 [%0];" ::"l"(res + idx));
  }
}

__host__ __device__ inline int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

// One area (reduce-scatter or all-gather) of one buffer: W - 1 slots of up to ceil(capacity / W)
// bytes plus one row of rounding (R = ceil(T / W) rows may exceed T / W by one).
inline int64_t area_bytes(int world, int64_t capacity) {
  return align256((world - 1) * ((capacity + world - 1) / world + kMaxRowBytes));
}

struct LamportLaunch {
  ResidualNormArgs args;
  PeerWait wait;
  PeerAddresses peers;
  void* state;
  int rank;
  int world;
  int64_t area_bytes;
  int64_t rows_per_rank;  // R
};

// Sources are handled in groups of kGroup ranks (rank order), so a thread holds at most kGroup
// packs in flight: one group (one wait per row) at W = 2, two at W = 3-4, four at W = 8. Larger
// groups spilled at VPT 1 (64 registers at 1024 threads; ptxas: 28 bytes with groups of 4).
constexpr int kGroup = 2;

// Waits until none of the packs at ``at[k]`` (null: no entry) holds the sentinel and returns them
// in ``v``: all loads are issued together and only the pending ones are reissued. Entry k is sent
// by rank first_sender + k (named in the timeout record). A wait that gives up (peer_wait.h)
// returns what the packs hold.
template <typename T>
__device__ __forceinline__ void wait_packs(uint4 (&v)[kGroup], uint4* const (&at)[kGroup], int first_sender,
                                           const LamportLaunch& p, PeerWaitSite site) {
#pragma unroll
  for (int k = 0; k < kGroup; ++k)
    if (at[k]) v[k] = ld_volatile(at[k]);
  uint64_t start = 0;
  int polls = 0;
  while (true) {
    int pending = -1;
#pragma unroll
    for (int k = kGroup - 1; k >= 0; --k) {
      if (at[k] && has_sentinel<T>(v[k])) {
        pending = k;
        v[k] = ld_volatile(at[k]);
      }
    }
    if (pending < 0) return;
    if ((++polls & 1023) == 0 && peer_wait_expired(p.wait, start, site, p.rank, first_sender + pending)) return;
  }
}

// Back to the sentinel: the packs just read (see the header for why no peer can be writing them).
template <typename T>
__device__ __forceinline__ void clear_packs(uint4* const (&at)[kGroup]) {
  const uint4 sentinel = sentinel_pack<T>();
#pragma unroll
  for (int k = 0; k < kGroup; ++k)
    if (at[k]) st_volatile(at[k], sentinel);
}

template <typename T, int VPT, QuantMode Q>
__global__ void __launch_bounds__(kMaxThreads) lamport_kernel(const LamportLaunch p) {
  __shared__ float scratch[33];
  const ResidualNormArgs& a = p.args;
  const int nvec = static_cast<int>(a.hidden / Pack<T>::kElems);
  WholeRow whole{0, nvec};
  const int world = p.world, me = p.rank, peers = p.world - 1;
  const int64_t R = p.rows_per_rank;
  const int64_t G = gridDim.x;
  const int64_t slot_packs = R * nvec;
  const uint4* x = static_cast<const uint4*>(a.x);

  pdl_wait();  // before any load: the inputs and the state may come from the previous kernel
  pdl_launch_dependents();
  const uint32_t call = read_call_slot(p.state).calls;
  const int64_t buffer = kStateBytes + static_cast<int64_t>(call & 1u) * 2 * p.area_bytes;
  // Area ``which`` (0: reduce-scatter, 1: all-gather) of the current buffer on rank ``owner``.
  auto area = [&](int owner, int which) {
    return reinterpret_cast<uint4*>(reinterpret_cast<char*>(p.peers[owner]) + buffer + which * p.area_bytes);
  };
  // The slot in ``owner``'s areas that holds rank ``src``'s rows.
  auto slot = [&](int src, int owner) { return (src - owner - 1 + world) % world; };
  const int steps = static_cast<int>((R - blockIdx.x + G - 1) / G);  // the host keeps G <= R
  auto chunk_row = [&](int step) { return blockIdx.x + static_cast<int64_t>(step) * G; };

  // push(s): row i of every other owner's chunk of x, to that owner; kGroup owners at a time, their
  // loads issued together.
  auto push = [&](int step) {
    const int64_t i = chunk_row(step);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx >= nvec) continue;
      for (int k0 = 0; k0 < peers; k0 += kGroup) {
        uint4 v[kGroup];
#pragma unroll
        for (int q = 0; q < kGroup; ++q) {
          const int owner = (me + 1 + k0 + q) % world;  // staggered: ranks do not all hit one peer at once
          const int64_t t = owner * R + i;
          if (k0 + q < peers && t < a.tokens) v[q] = clear_negative_zero<T>(__ldg(x + t * nvec + idx));
        }
#pragma unroll
        for (int q = 0; q < kGroup; ++q) {
          const int owner = (me + 1 + k0 + q) % world;
          const int64_t t = owner * R + i;
          if (k0 + q < peers && t < a.tokens)
            st_volatile(area(owner, 0) + slot(me, owner) * slot_packs + i * nvec + idx, v[q]);
        }
      }
    }
  };

  // reduce(s): this rank's row i: sum, round, send the sums, finish the row.
  auto reduce = [&](int step) {
    const int64_t i = chunk_row(step);
    const int64_t t = me * R + i;
    if (t >= a.tokens) return;  // the last owner's chunk may be short (uniform over the block)
    prefetch_residual<VPT>(a, t, nvec);
    RowRegs<T, VPT> regs;
    regs.zero();
    uint4* inbox = area(me, 0) + i * nvec;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int idx = j * blockDim.x + threadIdx.x;
      if (idx >= nvec) continue;
      const uint4 own = clear_negative_zero<T>(__ldg(x + t * nvec + idx));
      // Sources in rank order (the same order on every rank), kGroup ranks at a time.
      for (int src0 = 0; src0 < world; src0 += kGroup) {
        uint4* at[kGroup];
#pragma unroll
        for (int q = 0; q < kGroup; ++q) {
          const int src = src0 + q;
          at[q] = src < world && src != me ? inbox + slot(src, me) * slot_packs + idx : nullptr;
        }
        uint4 got[kGroup];
        wait_packs<T>(got, at, src0, p, PeerWaitSite::kLamportReduceScatter);
        clear_packs<T>(at);
#pragma unroll
        for (int q = 0; q < kGroup; ++q) {
          const int src = src0 + q;
          if (src < world) regs.add(j, src == me ? own : got[q]);
        }
      }
      // The value every rank finishes the row from: rounded, -0.0 flushed (the sentinel).
      const uint4 sum = clear_negative_zero<T>(regs.round(j));
      regs.set(j, sum);
      for (int k = 0; k < peers; ++k) {
        const int dest = (me + 1 + k) % world;
        st_volatile(area(dest, 1) + slot(me, dest) * slot_packs + i * nvec + idx, sum);
      }
    }
    finish_row<T, VPT, Q>(regs, t, a, nvec, scratch, whole);
  };

  // finish(s): row i of every other owner, from the sums it sent.
  auto finish = [&](int step) {
    const int64_t i = chunk_row(step);
    uint4* inbox = area(me, 1) + i * nvec;
    for (int k = 0; k < peers; ++k) {
      const int owner = (me + 1 + k) % world;  // slot k of this rank's all-gather area
      const int64_t t = owner * R + i;
      if (t >= a.tokens) continue;  // uniform over the block
      prefetch_residual<VPT>(a, t, nvec);
      RowRegs<T, VPT> regs;
      regs.zero();
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int idx = j * blockDim.x + threadIdx.x;
        if (idx >= nvec) continue;
        uint4* at[kGroup] = {};
        at[0] = inbox + k * slot_packs + idx;
        uint4 got[kGroup];
        wait_packs<T>(got, at, owner, p, PeerWaitSite::kLamportAllGather);
        clear_packs<T>(at);
        regs.set(j, got[0]);
      }
      finish_row<T, VPT, Q>(regs, t, a, nvec, scratch, whole);
    }
  };

  // The software pipeline: step s pushes row s, reduces row s - 1, finishes rows s - 2.
  for (int s = 0; s < steps + 2; ++s) {
    if (s < steps) push(s);
    if (s >= 1 && s - 1 < steps) reduce(s - 1);
    if (s >= 2) finish(s - 2);
  }

  write_call_slots(p.state, call + 1);
}

template <typename T>
__global__ void fill_sentinel_kernel(uint4* data, int64_t packs) {
  const uint4 sentinel = sentinel_pack<T>();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    data[i] = sentinel;
}

}  // namespace

int64_t lamport_region_bytes(int world, int64_t capacity) {
  return kStateBytes + 4 * area_bytes(world, capacity);
}

const char* lamport_init(const PeerRegion& region, int dtype, cudaStream_t stream) {
  if (region.world < 1 || region.world > kMaxWorld) return "opfuse Lamport two-shot: world out of range (1..8)";
  if (lamport_region_bytes(region.world, region.capacity) > region.bytes) return "opfuse Lamport two-shot: region too small";
  if (cudaMemsetAsync(region.local, 0, kStateBytes, stream) != cudaSuccess) return launch_status();
  const int64_t packs = 4 * area_bytes(region.world, region.capacity) / kPackBytes;
  if (packs == 0) return nullptr;
  uint4* data = reinterpret_cast<uint4*>(static_cast<char*>(region.local) + kStateBytes);
  if (dtype == static_cast<int>(DType::kFloat32))
    fill_sentinel_kernel<float><<<512, 256, 0, stream>>>(data, packs);
  else
    fill_sentinel_kernel<__nv_bfloat16><<<512, 256, 0, stream>>>(data, packs);
  return launch_status();
}

const char* allreduce_lamport(const ResidualNormArgs& args, const PeerRegion& region, const PeerWait& wait,
                              int max_blocks, bool pdl, cudaStream_t stream) {
  if (const char* bad = check_residual_norm_args(args)) return bad;
  if (region.world < 1 || region.world > kMaxWorld || region.rank < 0 || region.rank >= region.world)
    return "opfuse Lamport two-shot: rank/world out of range (world 1..8)";
  if (max_blocks < 1) return "opfuse Lamport two-shot: max_blocks must be >= 1";
  const int64_t row_bytes = args.hidden * dtype_size(args.dtype);
  if (row_bytes > kMaxRowBytes) return "opfuse Lamport two-shot: rows larger than 128 KiB are not supported";
  if (args.tokens * row_bytes > region.capacity) return "opfuse Lamport two-shot: message larger than the region capacity";
  if (lamport_region_bytes(region.world, region.capacity) > region.bytes) return "opfuse Lamport two-shot: region too small";
  if (args.tokens == 0) return nullptr;
  const int64_t rows_per_rank = (args.tokens + region.world - 1) / region.world;
  const int64_t area = area_bytes(region.world, region.capacity);
  if ((region.world - 1) * rows_per_rank * row_bytes > area)  // guaranteed by the capacity check; kept as a guard
    return "opfuse Lamport two-shot: message does not fit the region's areas";
  const RowLayout layout = row_layout(args.hidden, args.dtype);
  const int64_t cap = max_blocks < kCallSlots ? max_blocks : kCallSlots;  // the same on every rank
  const int blocks = static_cast<int>(rows_per_rank < cap ? rows_per_rank : cap);
  LamportLaunch launch{args, wait, region.addresses, region.local, region.rank, region.world,
                       area, rows_per_rank};
  return dispatch_peer_row_kernel(args.dtype, layout.vpt, args.quant,
                                  [&]<typename T, int VPT, QuantMode Q>() -> const char* {
    return launch_kernel(lamport_kernel<T, VPT, Q>, blocks, layout.threads, stream, pdl, launch);
  });
}

}  // namespace opfuse
