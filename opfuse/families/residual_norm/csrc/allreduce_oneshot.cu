// One-shot all-reduce (+ bias + residual + RMSNorm/LayerNorm) with Lamport-style receive buffers.
//
// Every rank pushes its whole message into slot [its rank] of every peer's receive buffer, then
// reads all slots of its own buffer, spinning on each 16-byte pack until no element holds the
// -0.0 sentinel. No flags, no barrier: the data is the flag. The sum runs in rank order 0..W-1
// in float32 on every rank, so all ranks produce bitwise-identical results.
//
// Three receive buffers rotate: call k writes buffer k%3 and clears (back to the sentinel) the
// part of buffer (k-1)%3 that call k-1 filled. It clears after pushing, so the local stores
// overlap the transfer. That is safe because peers write buffer (k-1)%3 again only at call k+2,
// and a peer reaches call k+2 only after its call k+1 received this rank's call-k+1 data, which
// this rank pushes from its next launch, after this whole call (clearing included) finished. No
// peer writes buffer (k-1)%3 during call k either: call k-1 already received every peer's
// data (a peer that timed out is the exception; the host then refuses further calls). Which
// buffer, and how much of it is dirty, lives in device memory, so the kernel needs nothing from
// the host per call and can be captured in CUDA graphs.
//
// Blocks: every block pushes an equal share of the message (several SMs per row at small token
// counts), clears its share of the previous buffer, then blocks [0, tokens) reduce and normalise
// one row at a time. Before a row's first wait a block requests everything else the row needs
// (its own contribution, the bias, residual and norm weight), so those loads' latency overlaps
// the peers' transfer instead of following it.
//
// Region layout (bytes): [0, 256) state; then 3 buffers of world * capacity bytes.
//   state[0]: completed calls (the iteration counter);  state[1]: blocks finished in this call;
//   state[2 + b]: elements of buffer b that the last call using it filled.

#include "row.cuh"

namespace opfuse {
namespace {

constexpr int64_t kStateBytes = 256;
constexpr int64_t kPushPacksPerBlock = 128;  // 2 KiB per peer per block

inline int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

inline int64_t buffer_bytes(int world, int64_t capacity) { return align256(world * capacity); }

struct OneShotLaunch {
  ResidualNormArgs args;
  PeerWait wait;
  const uint64_t* peers;
  uint32_t* state;
  int rank;
  int world;
  int64_t buffer_bytes;
};

// Rows with at most this many packs per thread hold their operands in registers across the wait
// (kernels are bounded to 64 registers at 1024 threads; larger rows would spill).
constexpr int kHeldMaxVpt = 1;

// Pack ``slot`` of a peer's message, once it has arrived (no element is the sentinel), or what it
// holds when the wait gives up (a peer that never arrives: the sentinels sum as -0.0).
template <typename T>
__device__ __forceinline__ uint4 wait_arrival(const uint4* slot, const OneShotLaunch& p, int src) {
  uint64_t start = 0;
  int polls = 0;
  while (true) {
    const uint4 value = ld_volatile(slot);
    if (!has_sentinel<T>(value)) return value;
    if ((++polls & 1023) == 0 && peer_wait_expired(p.wait, start, PeerWaitSite::kOneShot, p.rank, src))
      return value;
  }
}

template <typename T, int VPT, QuantMode Q>
__global__ void __launch_bounds__(kMaxThreads) oneshot_kernel(const OneShotLaunch p) {
  constexpr bool kHeld = VPT <= kHeldMaxVpt;
  __shared__ float scratch[33];
  const ResidualNormArgs& a = p.args;
  const int nvec = static_cast<int>(a.hidden / Pack<T>::kElems);
  const int64_t message_packs = a.tokens * nvec;  // packs per rank slot

  // With PDL (launch_kernel) everything above pdl_wait overlaps the previous kernel's tail; the
  // inputs and the region's state are read after it.
  pdl_wait();
  pdl_launch_dependents();
  const uint4* x = static_cast<const uint4*>(a.x);
  const int64_t per_block = (message_packs + gridDim.x - 1) / gridDim.x;
  const int64_t push_begin = blockIdx.x * per_block + threadIdx.x;
  const int64_t push_end = blockIdx.x * per_block + per_block < message_packs ? blockIdx.x * per_block + per_block
                                                                              : message_packs;
  // The first pack this thread pushes is requested before the call state, so the two loads'
  // latencies overlap (the acquire below only orders the loads after it).
  const uint4 first_pack = push_begin < push_end ? __ldg(x + push_begin) : make_uint4(0u, 0u, 0u, 0u);
  const uint32_t iteration = read_call_state(p.state);
  const int current = iteration % 3;
  const int previous = (iteration + 2) % 3;
  char* local = reinterpret_cast<char*>(p.peers[p.rank]);

  // 1. Push this rank's message into slot [rank] of every peer's current buffer. The message is
  //    split into equal pack ranges over *all* blocks (there may be more blocks than rows): one
  //    SM cannot keep enough remote stores in flight, so a single-token message spread over
  //    several SMs arrives sooner.
  {
    for (int64_t i = push_begin; i < push_end; i += blockDim.x) {
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

  // 2. Return the part of the previous buffer that was used to the sentinel, while the pushes
  //    are in flight (the header says why no peer can be writing it).
  {
    uint4* prev = reinterpret_cast<uint4*>(local + kStateBytes + previous * p.buffer_bytes);
    const int64_t dirty_packs = p.state[2 + previous] / Pack<T>::kElems;
    const uint4 sentinel = sentinel_pack<T>();
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < dirty_packs;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      prev[i] = sentinel;
  }

  // 3. Reduce every row this block owns, in rank order, then the epilogue.
  const uint4* inbox = reinterpret_cast<const uint4*>(local + kStateBytes + current * p.buffer_bytes);
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    // Local loads first, the waits after them: the operands and this rank's own contribution
    // (-0.0 flushed, as its peers receive it) are in flight while the peers' packs arrive.
    HeldOperands<T, VPT> in;
    if constexpr (kHeld) in.load(row, a, nvec);
    uint4 own[VPT];
    if constexpr (kHeld) {
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int idx = j * blockDim.x + threadIdx.x;
        own[j] = idx < nvec ? clear_negative_zero<T>(__ldg(x + row * nvec + idx)) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    RowRegs<T, VPT> regs;
    regs.zero();
    for (int src = 0; src < p.world; ++src) {
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int idx = j * blockDim.x + threadIdx.x;
        if (idx >= nvec) continue;
        uint4 value;
        if (src != p.rank)
          value = wait_arrival<T>(inbox + src * message_packs + row * nvec + idx, p, src);
        else if constexpr (kHeld)
          value = own[j];
        else
          value = clear_negative_zero<T>(__ldg(x + row * nvec + idx));
        regs.add(j, value);
      }
    }
    finish_row<T, VPT, Q>(regs, row, a, nvec, scratch, kHeld ? &in : nullptr);
  }

  // 4. The last block to finish advances the iteration and records how much it dirtied.
  publish_call(p.state, iteration + 1, [&] {
    p.state[2 + current] = static_cast<uint32_t>(p.world * message_packs * Pack<T>::kElems);
  });
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
  return kStateBytes + 3 * buffer_bytes(world, align256(capacity));
}

const char* oneshot_init(const PeerRegion& region, int dtype, cudaStream_t stream) {
  if (cudaMemsetAsync(region.local, 0, kStateBytes, stream) != cudaSuccess) return launch_status();
  const int64_t packs = 3 * buffer_bytes(region.world, align256(region.capacity)) / kPackBytes;
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
  // At least one block per row (up to max_blocks), and enough blocks that each pushes at most
  // kPushPacksPerBlock packs.
  const int64_t packs = args.tokens * layout.nvec;
  int64_t want = (packs + kPushPacksPerBlock - 1) / kPushPacksPerBlock;
  if (want < args.tokens) want = args.tokens;
  const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
  OneShotLaunch launch{args, wait, region.peers, static_cast<uint32_t*>(region.local), region.rank, region.world,
                       buffer_bytes(region.world, align256(region.capacity))};
  return dispatch_peer_row_kernel(args.dtype, layout.vpt, args.quant,
                                  [&]<typename T, int VPT, QuantMode Q>() -> const char* {
    return launch_kernel(oneshot_kernel<T, VPT, Q>, blocks, layout.threads, stream, pdl, launch);
  });
}

}  // namespace opfuse
