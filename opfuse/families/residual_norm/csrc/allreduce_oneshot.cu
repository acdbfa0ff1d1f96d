// One-shot all-reduce (+ bias + residual + RMSNorm/LayerNorm) with Lamport-style receive buffers.
//
// Every rank pushes its whole message into slot [its rank] of every peer's receive buffer, then
// reads all slots of its own buffer, spinning on each 16-byte pack until no element holds the
// -0.0 sentinel. No flags, no barrier: the data is the flag. The sum runs in rank order 0..W-1
// in float32 on every rank, so all ranks produce bitwise-identical results.
//
// Two receive buffers alternate: call k writes buffer k%2, and the receiver writes the sentinel
// back into every pack right after reading it, so between calls a buffer holds only sentinels
// whatever the earlier sizes were (no clear pass, no record of what is dirty). That is safe because
// a peer writes buffer k%2 again only at call k+2, which it reaches only after its call k+1
// received this rank's call-k+1 data, pushed from this rank's next launch, after this whole call
// (the write-backs included) finished; a peer that timed out is the exception, and the host then
// refuses further calls. Writing the sentinel while the line is still in L2 (it was just read)
// costs no extra HBM traffic over the clear pass it replaces, and none of it delays the rows. The
// buffer index lives in device memory (per-block call slots, row.cuh), so the kernel needs nothing
// from the host per call, can be captured in CUDA graphs, and ends without any grid-wide step: a
// block is done when its own rows are.
//
// Blocks: every block pushes its share of the message (several SMs per row at small token
// counts; in row order when it takes several waves), then blocks [0, tokens) reduce and
// normalise one row at a time; at small token counts a row is split over a cluster of up to 8
// blocks instead (row_split, ClusterRow in row.cuh), each reducing and normalising its part, so no
// SM moves a whole row. Before a row's first wait a block requests everything else its part needs
// (its own contribution, the bias, residual and norm weight), so those loads' latency overlaps the
// peers' transfer instead of following it.
//
// Region layout (bytes): [0, kCallStateBytes) the call slots; then 2 buffers of world * capacity
// bytes (slot [rank] of this rank's buffers is never written: a rank does not push to itself).

#include <cstdlib>
#include <type_traits>

#include "row.cuh"

namespace opfuse {
namespace {

constexpr int64_t kStateBytes = kCallStateBytes;
constexpr int64_t kPushPacksPerBlock = 128;  // 2 KiB per peer per block

// A tuning knob from the environment variable ``name``: ``fallback`` when it is unset or not a
// positive number, otherwise clamped to [1, most]. Callers keep it in a function-local static
// (read once per process: a graph captured early and one captured later launch alike).
int64_t knob(const char* name, int64_t fallback, int64_t most) {
  const char* text = std::getenv(name);
  const long long value = text ? std::atoll(text) : 0;
  return value <= 0 ? fallback : value > most ? most : value;
}

// kPushPacksPerBlock, or OPFUSE_ONESHOT_PUSH_PACKS when set (read once per process): the tuning
// knob bench/allreduce_timeline.py --push-packs sweeps.
int64_t push_packs_per_block() {
  static const int64_t packs = knob("OPFUSE_ONESHOT_PUSH_PACKS", kPushPacksPerBlock, int64_t{1} << 30);
  return packs;
}

inline int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

inline int64_t buffer_bytes(int world, int64_t capacity) { return align256(world * capacity); }

struct OneShotLaunch {
  ResidualNormArgs args;
  PeerWait wait;
  PeerAddresses peers;
  void* state;
  uint64_t* timeline;  // PeerRegion::timeline
  int rank;
  int world;
  int poll_depth;      // poll_depth()
  int64_t buffer_bytes;
};

// The one-shot's phase stamps (row.cuh, bench/allreduce_timeline.py): kernel entry (before the
// PDL wait), call state read, this block's pushes issued, its first row's peer data arrived
// (thread 0's packs), its last row finished, the block's end; then (numbered last, so older
// records keep their columns) every thread's packs of the first row arrived (a barrier that only
// timed launches execute), and inside the first row's epilogue: the residual added and h stored,
// the norm's block reduction done (RowStamps).
enum OneShotPhase : int { kEntry = 0, kStateRead, kPushed, kArrived, kRowDone, kEnd, kAllArrived, kSummed, kReduced };

// Loads of a pack kept in flight while waiting for it (OPFUSE_ONESHOT_POLL_DEPTH, 1 or 2, read
// once per process; default 1): with one, a pack that lands just after a poll was answered is seen
// a whole L2 round trip later; with two, staggered by half a round trip, half of one. (Deeper
// spills: the kernel has 64 registers per thread at 1024 threads.)
constexpr int kMaxPollDepth = 2;

int poll_depth() {
  static const int depth = static_cast<int>(knob("OPFUSE_ONESHOT_POLL_DEPTH", 1, kMaxPollDepth));
  return depth;
}

// Blocks per row (row_split): a part of at least this many packs per block (2 KiB), so the
// cluster exchange of each reduction (~0.3 us) is paid only where the row's bytes per SM are the
// cost (on simulated ranks: hidden 8192 in 8 parts of 128 packs 4.44 -> 3.64 us at one token,
// hidden 5120 in 8 parts of 80 no faster than whole rows; docs/PERF_NOTES.md, session 23).
constexpr int kMinPartPacks = 128;
// ... and at most this many (one per thread; the split kernels' register bound is that of 512 threads).
constexpr int kMaxPartThreads = 512;
static_assert(kMaxPartThreads <= 32 * kMaxClusterRowWarps, "ClusterRowShared holds a total per warp");

// kMaxClusterRow, or OPFUSE_ONESHOT_ROW_SPLIT when set (1: whole rows; read once per process, knob()):
// the largest number of blocks a row may be split over.
int max_row_split() {
  static const int limit = static_cast<int>(knob("OPFUSE_ONESHOT_ROW_SPLIT", kMaxClusterRow, kMaxClusterRow));
  return limit;
}

// The blocks (a cluster) each row is split over: the largest power of two up to max_row_split()
// with every row's cluster resident at once (tokens x split <= max_blocks, the SM count), parts
// of kMinPartPacks to kMaxPartThreads packs (one per thread); 1 (whole rows) otherwise. The same
// on every rank (the same sizes and GPU kind), so ranks sum in the same order.
int row_split(int64_t tokens, int nvec, int max_blocks) {
  for (int split = kMaxClusterRow; split > 1; split /= 2) {
    const int span = part_span(nvec, split);
    if (split <= max_row_split() && tokens * split <= max_blocks && span >= kMinPartPacks && span <= kMaxPartThreads)
      return split;
  }
  return 1;
}

// Rows with at most this many packs per thread hold their operands in registers across the wait
// (kernels are bounded to 64 registers at 1024 threads; larger rows would spill).
constexpr int kHeldMaxVpt = 1;

// Pack ``slot`` of a peer's message, once it has arrived (no element is the sentinel), or what it
// holds when the wait gives up (a peer that never arrives: the sentinels sum as -0.0).
template <typename T>
__device__ __forceinline__ uint4 wait_arrival(const uint4* slot, const OneShotLaunch& p, int src) {
  uint64_t start = 0;
  int polls = 0;
  uint4 value = ld_volatile(slot);
  if (!has_sentinel<T>(value)) return value;
  if (p.poll_depth <= 1) {
    while (true) {
      value = ld_volatile(slot);
      if (!has_sentinel<T>(value)) return value;
      if ((++polls & 1023) == 0 && peer_wait_expired(p.wait, start, PeerWaitSite::kOneShot, p.rank, src))
        return value;
    }
  }
  // Two loads in flight, issued half a round trip apart; each is reissued as soon as it is answered
  // without the data, which keeps them staggered.
  constexpr long long kHalfRoundTrip = 256;  // SM cycles (an L2 round trip is ~500)
  uint4 early = value;
  const long long issued = clock64();
  while (clock64() - issued < kHalfRoundTrip) {
  }
  uint4 late = ld_volatile(slot);
  while (true) {
    if (!has_sentinel<T>(early)) return early;
    early = ld_volatile(slot);
    if (!has_sentinel<T>(late)) return late;
    late = ld_volatile(slot);
    if ((++polls & 511) == 0 && peer_wait_expired(p.wait, start, PeerWaitSite::kOneShot, p.rank, src))
      return late;
  }
}

// kSplitRows: launched in clusters, the blocks of a cluster share each row (ClusterRow).
template <typename T, int VPT, QuantMode Q, bool kSplitRows>
__global__ void __launch_bounds__(kSplitRows ? kMaxPartThreads : kMaxThreads, 1) oneshot_kernel(const OneShotLaunch p) {
  constexpr bool kHeld = VPT <= kHeldMaxVpt;
  __shared__ float scratch[33];
  __shared__ ClusterRowShared cluster_row;  // ClusterRow's (unused without kSplitRows)
  const ResidualNormArgs& a = p.args;
  const int nvec = static_cast<int>(a.hidden / Pack<T>::kElems);
  const int64_t message_packs = a.tokens * nvec;  // packs per rank slot
  using Part = std::conditional_t<kSplitRows, ClusterRow, WholeRow>;

  // With PDL (launch_kernel) everything above pdl_wait overlaps the previous kernel's tail; the
  // inputs and the region's state are read after it.
  const uint64_t entry_ns = p.timeline ? global_timer_ns() : 0;
  Part part;
  int split = 1;
  if constexpr (kSplitRows) {
    part.init(&cluster_row);
    split = static_cast<int>(part.blocks);
    const int span = part_span(nvec, split);
    part.first = static_cast<int>(part.rank) * span;
    part.count = max(0, min(span, nvec - part.first));
  } else {
    part.count = nvec;
  }
  const int64_t first_row = blockIdx.x / split;  // rows go to clusters (of one block without kSplitRows)
  const int64_t row_step = gridDim.x / split;
  pdl_wait();
  pdl_launch_dependents();
  const uint4* x = static_cast<const uint4*>(a.x);
  // Pushes go in waves of gridDim.x x chunk packs in message order: wave w of block b is packs
  // [(w * gridDim.x + b) * chunk, +chunk). One wave (chunk = the block's equal share) when the
  // message fits; beyond that (chunk = blockDim.x) every block's early waves carry the low rows,
  // so rows arrive in the order the blocks reduce them (row r before row r + row_step) and a
  // block's first rows are normalised while its later ones are still on the wire.
  const int64_t share = (message_packs + gridDim.x - 1) / gridDim.x;
  const int64_t chunk = share < blockDim.x ? share : blockDim.x;
  const int64_t push_stride = gridDim.x * chunk;
  const int64_t push_begin = threadIdx.x < chunk ? blockIdx.x * chunk + threadIdx.x : message_packs;
  // The first pack this thread pushes is requested before the call state, so the two loads'
  // latencies overlap (the acquire below only orders the loads after it).
  const uint4 first_pack = push_begin < message_packs ? __ldg(x + push_begin) : make_uint4(0u, 0u, 0u, 0u);
  const CallState call = read_call_slot(p.state);
  const int current = call.calls % 2;
  char* local = static_cast<char*>(p.state);  // this rank's region (== peers[rank])
  if (p.timeline) {
    stamp(p.timeline, call.calls, kEntry, entry_ns);
    stamp(p.timeline, call.calls, kStateRead, timer_after(call.calls));
  }

  // 1. Push this rank's message into slot [rank] of every peer's current buffer. The message is
  //    split over *all* blocks (there may be more blocks than rows): one SM cannot keep enough
  //    remote stores in flight, so a single-token message spread over several SMs arrives sooner.
  {
    for (int64_t i = push_begin; i < message_packs; i += push_stride) {
      const uint4 value = clear_negative_zero<T>(i == push_begin ? first_pack : __ldg(x + i));
      for (int step = 1; step < p.world; ++step) {
        const int peer = (p.rank + step) % p.world;  // stagger so ranks do not all hit one peer
        uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<char*>(p.peers[peer]) + kStateBytes +
                                              current * p.buffer_bytes) +
                     p.rank * message_packs + i;
        st_volatile(dst, value);
      }
    }
  }
  if (p.timeline) stamp(p.timeline, call.calls, kPushed, global_timer_ns());

  // 2. Reduce every row this block owns, in rank order, then the epilogue; every received pack goes
  //    back to the sentinel as soon as it is read (the header says why no peer can be writing it).
  uint4* inbox = reinterpret_cast<uint4*>(local + kStateBytes + current * p.buffer_bytes);
  const uint4 sentinel = sentinel_pack<T>();
  for (int64_t row = first_row; row < a.tokens; row += row_step) {
    // Local loads first, the waits after them: the operands and this rank's own contribution
    // (-0.0 flushed, as its peers receive it) are in flight while the peers' packs arrive.
    HeldOperands<T, VPT> in;
    if constexpr (kHeld) in.load(row, a, nvec, part.first, part.count);
    uint4 own[VPT];
    if constexpr (kHeld) {
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int local = j * blockDim.x + threadIdx.x;
        own[j] = local < part.count ? clear_negative_zero<T>(__ldg(x + row * nvec + part.first + local))
                                    : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    RowRegs<T, VPT> regs;
    regs.zero();
    for (int src = 0; src < p.world; ++src) {
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int local = j * blockDim.x + threadIdx.x;
        if (local >= part.count) continue;
        const int idx = part.first + local;
        uint4 value;
        if (src != p.rank) {
          uint4* at = inbox + src * message_packs + row * nvec + idx;
          value = wait_arrival<T>(at, p, src);
          st_volatile(at, sentinel);
        } else if constexpr (kHeld)
          value = own[j];
        else
          value = clear_negative_zero<T>(__ldg(x + row * nvec + idx));
        regs.add(j, value);
      }
    }
    if (p.timeline && row == first_row) {
      stamp(p.timeline, call.calls, kArrived, timer_after(__float_as_uint(regs.v[0][0])));
      __syncthreads();  // uniform: p.timeline is the same for every thread
      stamp(p.timeline, call.calls, kAllArrived, global_timer_ns());
    }
    const RowStamps stamps{row == first_row ? p.timeline : nullptr, call.calls, kSummed, kReduced};
    finish_row<T, VPT, Q>(regs, row, a, nvec, scratch, part, kHeld ? &in : nullptr, stamps);
    if (p.timeline) stamp(p.timeline, call.calls, kRowDone, global_timer_ns());
  }

  // 3. The next call's state: one more completed call.
  write_call_slots(p.state, call.calls + 1);
  if (p.timeline) stamp(p.timeline, call.calls, kEnd, global_timer_ns());
}

template <typename T>
__global__ void fill_sentinel_kernel(uint4* data, int64_t packs) {
  const uint4 sentinel = sentinel_pack<T>();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    data[i] = sentinel;
}

}  // namespace

int64_t oneshot_region_bytes(int world, int64_t capacity) {
  return kStateBytes + 2 * buffer_bytes(world, align256(capacity));
}

const char* oneshot_init(const PeerRegion& region, int dtype, cudaStream_t stream) {
  if (oneshot_region_bytes(region.world, region.capacity) > region.bytes) return "opfuse one-shot: region too small";
  if (cudaMemsetAsync(region.local, 0, kStateBytes, stream) != cudaSuccess) return launch_status();
  const int64_t packs = 2 * buffer_bytes(region.world, align256(region.capacity)) / kPackBytes;
  uint4* data = reinterpret_cast<uint4*>(static_cast<char*>(region.local) + kStateBytes);
  if (dtype == static_cast<int>(DType::kFloat32))
    fill_sentinel_kernel<float><<<256, 256, 0, stream>>>(data, packs);
  else
    fill_sentinel_kernel<__nv_bfloat16><<<256, 256, 0, stream>>>(data, packs);
  return launch_status();
}

const char* allreduce_oneshot(const ResidualNormArgs& args, const PeerRegion& region, const PeerWait& wait,
                              int max_blocks, bool pdl, cudaStream_t stream) {
  if (const char* bad = check_residual_norm_args(args)) return bad;
  if (region.world < 1 || region.world > kMaxWorld || region.rank < 0 || region.rank >= region.world)
    return "opfuse one-shot: rank/world out of range (world 1..8)";
  const int64_t message = args.tokens * args.hidden * dtype_size(args.dtype);
  if (message > region.capacity) return "opfuse one-shot: message larger than the region capacity";
  if (oneshot_region_bytes(region.world, region.capacity) > region.bytes) return "opfuse one-shot: region too small";
  if (args.tokens == 0) return nullptr;
  const RowLayout layout = row_layout(args.hidden, args.dtype);
  if (max_blocks < 1) return "opfuse one-shot: max_blocks must be >= 1";
  // At least one block (a cluster of split blocks) per row, up to max_blocks and the call slots,
  // and enough blocks that each pushes at most kPushPacksPerBlock packs.
  const int split = row_split(args.tokens, layout.nvec, max_blocks);
  const int64_t packs = args.tokens * layout.nvec;
  const int64_t push_packs = push_packs_per_block();
  int64_t want = (packs + push_packs - 1) / push_packs;
  if (want < args.tokens * split) want = args.tokens * split;
  want = (want + split - 1) / split * split;
  const int64_t cap = (max_blocks < kCallSlots ? max_blocks : kCallSlots) / split * split;
  const int blocks = static_cast<int>(want < cap ? want : cap);
  const int span = part_span(layout.nvec, split);
  const int threads = split > 1 ? (span + 31) / 32 * 32 : layout.threads;
  OneShotLaunch launch{args,        wait,         region.addresses, region.local,
                       region.timeline, region.rank, region.world,     poll_depth(),
                       buffer_bytes(region.world, align256(region.capacity))};
  return dispatch_peer_row_kernel(args.dtype, split > 1 ? 1 : layout.vpt, args.quant,
                                  [&]<typename T, int VPT, QuantMode Q>() -> const char* {
    if (split == 1) return launch_kernel(oneshot_kernel<T, VPT, Q, false>, blocks, threads, stream, pdl, launch);
    if constexpr (VPT == 1)  // a split row's part is at most one pack per thread (row_split)
      return launch_cluster_kernel(oneshot_kernel<T, 1, Q, true>, blocks, threads, split, stream, pdl, launch);
    return "opfuse one-shot: internal error: a split row with more than one pack per thread";
  });
}

}  // namespace opfuse
