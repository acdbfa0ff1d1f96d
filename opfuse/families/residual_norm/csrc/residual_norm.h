// The residual-norm kernels' C++ API (raw pointers, sizes, a stream). Bound to Python in bindings.cpp.
//
// Every function returns nullptr on success or a static/thread-local message describing the
// failure (bad arguments, or the CUDA error of the launch). Tensors are row-major
// [tokens, hidden], contiguous, 16-byte aligned, of one dtype (DType); hidden * sizeof(dtype) must
// be a multiple of 16 (layer_norm_backward: any hidden, element-aligned pointers).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "peer_wait.h"

namespace opfuse {

enum class NormKind : int { kNone = 0, kRMS = 1, kLayer = 2 };

// The FP8 epilogue of the row finish (a compile-time parameter of the kernels; row.cuh). The
// normalised row is rounded to the activation dtype first (what the unfused norm returns), then:
//   kNone:    y written in the activation dtype;
//   kRowwise: one scale per row: q (FP8) and scales[row] = the row's scale_inv;
//   kRowAmax: first pass of one scale per tensor: scales[row] = the row's amax of y (h must be
//             written: the second pass reads it); y is not written;
//   kTensor:  second pass (add_norm over h): q with the scale of *amax; row 0 writes scales[0] =
//             scale_inv.
// Scales follow opfuse/fp8/numerics.py: scale = fp8_max / amax (1 where amax is 0, IEEE
// division), q = saturate(y * scale) rounded to nearest even, scale_inv = 1 / scale.
enum class QuantMode : int { kNone = 0, kRowwise = 1, kRowAmax = 2, kTensor = 3 };
enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

struct ResidualNormArgs {
  const void* x = nullptr;          // this rank's partial sums (single GPU: the activations)
  const void* bias = nullptr;       // [hidden], added after the reduction; may be null
  const void* residual = nullptr;   // [tokens, hidden]; may be null
  const void* weight = nullptr;     // norm weight [hidden]; may be null
  const void* norm_bias = nullptr;  // LayerNorm bias [hidden]; may be null
  void* y = nullptr;                // [tokens, hidden] output
  void* h = nullptr;                // [tokens, hidden] new residual (pre-norm sum); may be null
  int64_t tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;
  int norm = 0;   // NormKind: 0 none, 1 RMSNorm, 2 LayerNorm
  int dtype = 0;  // DType (runtime/csrc/dtype.h)
  // FP8 epilogue (QuantMode); with one, y is not written.
  int quant = 0;                // QuantMode
  int fp8 = 0;                  // Fp8Format of q
  void* q = nullptr;            // [tokens, hidden] FP8 output (kRowwise, kTensor)
  float* scales = nullptr;      // kRowwise: [tokens] scale_inv; kRowAmax: [tokens] amax; kTensor: [1] scale_inv
  const float* amax = nullptr;  // kTensor: the tensor's amax [1] (device)
};

constexpr int kMaxWorld = 8;

// The region's address on every rank, by value: kernels take it in their parameters (constant
// memory), so a push's destination needs no load from global memory after the call state's.
struct PeerAddresses {
  uint64_t at[kMaxWorld] = {};
  __host__ __device__ uint64_t operator[](int rank) const { return at[rank]; }
};

// One rank's view of a region of the symmetric pool: the same byte range on every rank.
struct PeerRegion {
  const uint64_t* peers = nullptr;  // device array [world]: the region's address on each rank
  PeerAddresses addresses;          // the same addresses, host copy (filled where PeerRegion is built)
  void* local = nullptr;            // this rank's region (== peers[rank], as a host-side value)
  int rank = 0;
  int world = 1;
  int64_t bytes = 0;                // region size
  int64_t capacity = 0;             // largest message (bytes per rank) the region was sized for
  uint64_t* timeline = nullptr;     // phase stamps of the one-shot's calls (row.cuh); null: none
};

// Grid cap of the one-shot and Lamport kernels: one call-state slot per block index (row.cuh).
constexpr int kCallSlots = 512;
// PeerRegion::timeline's shape: [kTimelineCalls, kCallSlots, kTimelinePhases] uint64 nanoseconds.
constexpr int kTimelineCalls = 64;
constexpr int kTimelinePhases = 9;
constexpr int kMaxBlocks = 128;  // two-shot grid (identical on every rank; <= SM count)

// Region sizes for a given world size and message capacity (bytes per rank).
int64_t oneshot_region_bytes(int world, int64_t capacity);
int64_t twoshot_region_bytes(int world, int64_t capacity);

// The peer kernels below take ``pdl``: launch with programmatic stream serialization (PDL), so the
// kernel's launch and scheduling overlap the previous kernel on the stream; the kernels read
// nothing before the grid-dependency wait (row.cuh, pdl_wait), so results are the same either way.

// Lamport one-shot all-reduce (+ bias + residual + norm). Epilogues: kNone, kRowwise, kRowAmax. The region must start zeroed state and
// sentinel-filled buffers (oneshot_init); ``max_blocks`` caps the grid. Waits on peers are
// bounded by ``wait`` (peer_wait.h).
const char* allreduce_oneshot(const ResidualNormArgs& args, const PeerRegion& region, const PeerWait& wait,
                              int max_blocks, bool pdl, cudaStream_t stream);
// Writes the initial state of a one-shot region on this rank (zero state, sentinel buffers).
const char* oneshot_init(const PeerRegion& region, int dtype, cudaStream_t stream);

// Two-shot all-reduce: reduce-scatter by token rows, all-gather the reduced rows, then every rank
// applies bias + residual + norm to all rows. Epilogues: kNone, kRowwise, kRowAmax. ``blocks`` must be the same on every rank. Waits on
// peers are bounded by ``wait`` (peer_wait.h).
const char* allreduce_twoshot(const ResidualNormArgs& args, const PeerRegion& region, const PeerWait& wait,
                              int blocks, bool pdl, cudaStream_t stream);
const char* twoshot_init(const PeerRegion& region, cudaStream_t stream);

// Pipelined two-shot with Lamport receive buffers (allreduce_lamport.cu): reduce-scatter by token
// rows and all-gather of the rounded sums, every 16-byte store self-signalling (the -0.0 sentinel),
// each block's pushes running a step ahead of its reductions and norms; no flags, no fences. Grid:
// min(max_blocks, ceil(tokens / world)); results do not depend on it, but ``max_blocks`` should be
// the same on every rank (then blocks only wait for the same-index blocks of peers, and the grid
// needs no co-residency on one GPU). Epilogues: kNone, kRowwise, kRowAmax. The region must start with
// zeroed state and sentinel-filled buffers (lamport_init).
int64_t lamport_region_bytes(int world, int64_t capacity);
const char* lamport_init(const PeerRegion& region, int dtype, cudaStream_t stream);
const char* allreduce_lamport(const ResidualNormArgs& args, const PeerRegion& region, const PeerWait& wait,
                              int max_blocks, bool pdl, cudaStream_t stream);

// Single GPU: y = norm(x + bias + residual), h = the sum. Epilogues: kNone, kTensor.
const char* add_norm(const ResidualNormArgs& args, int max_blocks, cudaStream_t stream);

struct RMSNormBackwardArgs {
  const void* dy = nullptr;      // [tokens, hidden]
  const void* h = nullptr;       // [tokens, hidden] the norm's input
  const void* weight = nullptr;  // [hidden]; may be null
  const void* dh_out = nullptr;  // [tokens, hidden] gradient reaching h from elsewhere; may be null
  void* dh = nullptr;            // [tokens, hidden] output
  float* dw_partial = nullptr;   // [blocks, hidden] float32 scratch (when weight is set)
  void* dw = nullptr;            // [hidden] output (when weight is set)
  int64_t tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;
  int dtype = 0;
};

// dh = d(rmsnorm)/dh . dy (+ dh_out); dw = sum_tokens(dy * h * rstd). ``blocks`` sizes dw_partial.
const char* rms_norm_backward(const RMSNormBackwardArgs& args, int blocks, cudaStream_t stream);

struct LayerNormBackwardArgs {
  const void* dy = nullptr;      // [tokens, hidden]
  const void* h = nullptr;       // [tokens, hidden] the norm's input
  const void* weight = nullptr;  // [hidden]; may be null
  const void* dh_out = nullptr;  // [tokens, hidden] gradient reaching h from elsewhere; may be null
  void* dh = nullptr;            // [tokens, hidden] output
  float* partial = nullptr;      // [2, blocks, hidden] float32 scratch (when dw or db is set)
  void* dw = nullptr;            // [hidden] output; may be null (no weight gradient)
  void* db = nullptr;            // [hidden] output; may be null (no norm-bias gradient)
  int64_t tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-5f;
  int dtype = 0;
};

// With mean and rstd recomputed from h, xhat = (h - mean) * rstd and g = dy * w:
// dh = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dh_out); dw = sum_tokens(dy * xhat);
// db = sum_tokens(dy). ``blocks`` sizes partial. Any hidden > 0 and any element-aligned pointers:
// rows of whole 16-byte packs at 16-byte aligned addresses take the vectorised kernel, others a
// scalar one. Deterministic: no atomics, a fixed summation order for a given ``blocks``.
const char* layer_norm_backward(const LayerNormBackwardArgs& args, int blocks, cudaStream_t stream);

}  // namespace opfuse
