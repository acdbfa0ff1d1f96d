// Two-shot all-reduce (+ bias + residual + norm) for large messages, over peer memory with
// per-block flags.
//
// Tokens are split into W chunks of R = ceil(T / W) rows; rank j owns chunk j. Block b of every
// rank handles rows i = b, b + G, ... (G = gridDim.x, identical on all ranks) of every chunk, in
// stages of a few rows. For each stage s:
//
//   A. push the stage's rows of chunk j (j != rank) of x into slot [rank] of rank j's
//      reduce-scatter area, then set flag A[b][rank] = seq + s + 1 on rank j (release);
//   B. wait for flags A[b][*] >= seq + s + 1 on this rank (acquire), sum the stage's rows of its
//      own chunk over the W slots in rank order (float32), round to the dtype, and push the sums
//      into every rank's all-gather area; set flag B[b][rank] on every peer;
//   C. wait for flags B[b][*], then apply bias + residual + norm to the stage's rows of every chunk.
//
// A block runs A(s), B(s-1), C(s-2) in turn (a software pipeline), so its NVLink pushes are in
// flight while it does the HBM-bound norm of earlier rows. Each rank sends 2 (W-1)/W of the
// message over NVLink, the minimum for an all-reduce without multicast. Flags hold a sequence
// number that only grows (state[0] counts stages of all calls): no reset between calls, and a
// later value also satisfies an earlier wait. Buffers are reused safely: a peer can only start
// call k+1's pushes after this rank pushed its own call-k+1 data, i.e. after it finished reading
// call k's. All ranks compute phase C from the same reduced rows, so outputs are bitwise
// identical across ranks.
//
// Region layout (bytes): [0, 256) state; flags A and B (kMaxBlocks x kMaxWorld u32 each);
// reduce-scatter area (W slots of R rows); all-gather area (T rows). Areas are sized for the
// region's capacity.

#include "row.cuh"

namespace opfuse {
namespace {

constexpr int64_t kStateBytes = 256;
constexpr int64_t kFlagBytes = 2LL * kMaxBlocks * kMaxWorld * sizeof(uint32_t);
constexpr int64_t kMaxRowBytes = 65536LL * 2;
constexpr int64_t kMaxStages = 8;
constexpr int64_t kMinStageRows = 2;

__host__ __device__ inline int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }
__host__ __device__ inline int64_t rs_bytes(int world, int64_t capacity) { return align256(capacity + world * kMaxRowBytes); }
__host__ __device__ inline int64_t rs_offset() { return kStateBytes + kFlagBytes; }
__host__ __device__ inline int64_t ag_offset(int world, int64_t capacity) { return rs_offset() + rs_bytes(world, capacity); }

struct TwoShotLaunch {
  ResidualNormArgs args;
  PeerWait wait;
  const uint64_t* peers;
  uint32_t* state;
  int rank;
  int world;
  int64_t ag_offset;
  int64_t rows_per_stage;
};

__device__ __forceinline__ uint32_t* flag_ptr(uint64_t base, int phase, int block, int src) {
  return reinterpret_cast<uint32_t*>(base + kStateBytes) + (phase * kMaxBlocks + block) * kMaxWorld + src;
}

__device__ __forceinline__ void signal_peers(const TwoShotLaunch& p, int phase, uint32_t epoch) {
  // Called after __syncthreads(): every thread's pushes of this block precede the release.
  const int peer = threadIdx.x;
  if (peer < p.world && peer != p.rank) {
    __threadfence_system();
    st_release_sys(flag_ptr(p.peers[peer], phase, blockIdx.x, p.rank), epoch);
  }
}

__device__ __forceinline__ void wait_peers(const TwoShotLaunch& p, int phase, uint32_t epoch, PeerWaitSite site) {
  const int src = threadIdx.x;
  if (src < p.world && src != p.rank) {
    const uint32_t* flag = flag_ptr(p.peers[p.rank], phase, blockIdx.x, src);
    uint64_t start = 0;
    int polls = 0;
    while (static_cast<int32_t>(ld_acquire_sys(flag) - epoch) < 0) {
      // A peer that never arrives: give up after the timeout; the block goes on with stale rows
      // (every thread still reaches the same barriers) and the host raises before the next call.
      if ((++polls & 1023) == 0 && peer_wait_expired(p.wait, start, site, p.rank, src)) break;
    }
  }
  __syncthreads();
}

template <typename T, int VPT, QuantMode Q>
__global__ void __launch_bounds__(kMaxThreads) twoshot_kernel(const TwoShotLaunch p) {
  __shared__ float scratch[33];
  const ResidualNormArgs& a = p.args;
  const int nvec = static_cast<int>(a.hidden / Pack<T>::kElems);
  WholeRow whole{0, nvec};
  const int64_t rows_per_rank = (a.tokens + p.world - 1) / p.world;
  const int64_t G = gridDim.x;
  // Stage s of this block covers chunk rows i = blockIdx.x + (s * R + r) * G, r < R.
  const int64_t R = p.rows_per_stage;
  const int stages = static_cast<int>((rows_per_rank + G * R - 1) / (G * R));
  pdl_wait();  // with PDL (launch_kernel): the inputs and the state are read after the previous kernel
  pdl_launch_dependents();
  const uint32_t seq0 = read_call_state(p.state);
  const uint4* x = static_cast<const uint4*>(a.x);

  auto rs_slot = [&](int owner, int src, int64_t i) {  // row i of src's contribution, on owner
    return reinterpret_cast<uint4*>(reinterpret_cast<char*>(p.peers[owner]) + rs_offset()) +
           (src * rows_per_rank + i) * nvec;
  };
  auto ag_row = [&](int owner, int64_t t) {
    return reinterpret_cast<uint4*>(reinterpret_cast<char*>(p.peers[owner]) + p.ag_offset) + t * nvec;
  };
  auto row_of = [&](int stage, int r) { return blockIdx.x + (static_cast<int64_t>(stage) * R + r) * G; };

  // A(s): push rows of stage s of every other rank's chunk to that rank.
  auto push_stage = [&](int stage) {
    for (int r = 0; r < R; ++r) {
      const int64_t i = row_of(stage, r);
      if (i >= rows_per_rank) break;
      for (int step = 1; step < p.world; ++step) {
        const int owner = (p.rank + step) % p.world;
        const int64_t t = owner * rows_per_rank + i;
        if (t >= a.tokens) continue;
        uint4* dst = rs_slot(owner, p.rank, i);
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          const int idx = j * blockDim.x + threadIdx.x;
          if (idx < nvec) dst[idx] = __ldg(x + t * nvec + idx);
        }
      }
    }
    __syncthreads();
    signal_peers(p, 0, seq0 + stage + 1);
  };

  // B(s): reduce this rank's rows of stage s over all slots, push the sums to every rank.
  auto reduce_stage = [&](int stage) {
    wait_peers(p, 0, seq0 + stage + 1, PeerWaitSite::kTwoShotReduceScatter);
    const uint4* own_rs = rs_slot(p.rank, 0, 0);
    for (int r = 0; r < R; ++r) {
      const int64_t i = row_of(stage, r);
      const int64_t t = p.rank * rows_per_rank + i;
      if (i >= rows_per_rank || t >= a.tokens) break;
      RowRegs<T, VPT> regs;
      regs.zero();
      for (int src = 0; src < p.world; ++src) {
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          const int idx = j * blockDim.x + threadIdx.x;
          if (idx >= nvec) continue;
          regs.add(j, src == p.rank ? __ldg(x + t * nvec + idx)
                                    : ld_l2(own_rs + (src * rows_per_rank + i) * nvec + idx));
        }
      }
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int idx = j * blockDim.x + threadIdx.x;
        if (idx >= nvec) continue;
        const uint4 sum = regs.round(j);
        for (int step = 0; step < p.world; ++step) ag_row((p.rank + step) % p.world, t)[idx] = sum;
      }
    }
    __syncthreads();
    signal_peers(p, 1, seq0 + stage + 1);
  };

  // C(s): bias + residual + norm for rows of stage s of every chunk.
  auto finish_stage = [&](int stage) {
    wait_peers(p, 1, seq0 + stage + 1, PeerWaitSite::kTwoShotAllGather);
    for (int r = 0; r < R; ++r) {
      const int64_t i = row_of(stage, r);
      if (i >= rows_per_rank) break;
      for (int owner = 0; owner < p.world; ++owner) {
        const int64_t t = owner * rows_per_rank + i;
        if (t >= a.tokens) break;
        RowRegs<T, VPT> regs;
        regs.zero();
        const uint4* sums = ag_row(p.rank, t);
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          const int idx = j * blockDim.x + threadIdx.x;
          if (idx < nvec) regs.add(j, ld_l2(sums + idx));
        }
        finish_row<T, VPT, Q>(regs, t, a, nvec, scratch, whole);
      }
    }
  };

  // Software pipeline: the pushes of stage s go out before the reduction of stage s-1 and the
  // norm of stage s-2, so NVLink transfers overlap this block's HBM-bound work.
  for (int s = 0; s < stages + 2; ++s) {
    if (s < stages) push_stage(s);
    if (s >= 1 && s <= stages) reduce_stage(s - 1);
    if (s >= 2) finish_stage(s - 2);
  }

  // The last block to finish publishes the sequence number.
  publish_call(p.state, seq0 + static_cast<uint32_t>(stages), [] {});
}

}  // namespace

int64_t twoshot_region_bytes(int world, int64_t capacity) {
  return ag_offset(world, capacity) + align256(capacity);
}

const char* twoshot_init(const PeerRegion& region, cudaStream_t stream) {
  // State and flags start at zero; data areas need no initial value.
  if (cudaMemsetAsync(region.local, 0, kStateBytes + kFlagBytes, stream) != cudaSuccess) return launch_status();
  return nullptr;
}

const char* allreduce_twoshot(const ResidualNormArgs& args, const PeerRegion& region, const PeerWait& wait,
                              int blocks, bool pdl, cudaStream_t stream) {
  if (const char* bad = check_residual_norm_args(args)) return bad;
  if (region.world < 1 || region.world > kMaxWorld || region.rank < 0 || region.rank >= region.world)
    return "opfuse two-shot: rank/world out of range (world 1..8)";
  if (blocks < 1 || blocks > kMaxBlocks) return "opfuse two-shot: blocks must be in 1..128";
  const int64_t row_bytes = args.hidden * dtype_size(args.dtype);
  if (row_bytes > kMaxRowBytes) return "opfuse two-shot: rows larger than 128 KiB are not supported";
  if (args.tokens * row_bytes > region.capacity) return "opfuse two-shot: message larger than the region capacity";
  if (twoshot_region_bytes(region.world, region.capacity) > region.bytes) return "opfuse two-shot: region too small";
  if (args.tokens == 0) return nullptr;
  const RowLayout layout = row_layout(args.hidden, args.dtype);
  // Rows per stage: at most kMaxStages stages per block and at least kMinStageRows rows per stage
  // (each stage costs two flag hand-offs; measured: 8 one-row stages at 8 rows per block were 24%
  // slower than one stage, 8 stages of 2-4 rows at 16-32 rows per block 2-10% faster).
  const int64_t rows_per_rank = (args.tokens + region.world - 1) / region.world;
  const int64_t per_block = (rows_per_rank + blocks - 1) / blocks;
  int64_t rows_per_stage = (per_block + kMaxStages - 1) / kMaxStages;
  if (rows_per_stage < kMinStageRows) rows_per_stage = kMinStageRows;
  TwoShotLaunch launch{args, wait, region.peers, static_cast<uint32_t*>(region.local), region.rank, region.world,
                       ag_offset(region.world, region.capacity), rows_per_stage};
  return dispatch_peer_row_kernel(args.dtype, layout.vpt, args.quant,
                                  [&]<typename T, int VPT, QuantMode Q>() -> const char* {
    return launch_kernel(twoshot_kernel<T, VPT, Q>, blocks, layout.threads, stream, pdl, launch);
  });
}

}  // namespace opfuse
