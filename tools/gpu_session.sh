#!/usr/bin/env bash
# The one command sent to a lent GPU machine: build the extension, run the GPU tests and the
# benchmarks of a stage, keep every log under $OUT, and print a short summary last.
#
#   tools/gpu_session.sh validate  # 1-4 GPUs: every GPU test but the optional libraries' (nvidia-libs), no benchmarks
#   tools/gpu_session.sh correctness  # 1-2 GPUs: the bounded peer waits and rounding tests, host overhead
#   tools/gpu_session.sh validate-multi  # the same without the grouped-GEMM tests
#   tools/gpu_session.sh one-gpu   # 1 GPU, everything one chip can check (~8 min on H100): kernels (simulated
#                                  # ranks), fused ops, grouped GEMM tests + bench + tuning, FP8 at world 1, host
#                                  # overhead, then the optional NVIDIA libraries (carry .whl)
#   tools/gpu_session.sh x2-tests  # 2 GPUs (~6 min on 2x H200): every test that needs two GPUs (NCCL, peer
#                                  # memory, cuBLASMp; carry .whl), the kernels again, grouped bench + tuning on this GPU
#   tools/gpu_session.sh x2-final  # 2 GPUs: the two-GPU tests and world-2 benchmarks that matter most, in one call
#   tools/gpu_session.sh x2-bench  # 2 GPUs (~9 min): world-2 benchmarks in one call: all-reduce + norm with the
#                                  # FlashInfer column (carry .thirdparty) and the crossover sweep, block.py, model.py
#                                  # (decode 1 64, train 2048), cuBLASMp vs p2p_overlap (carry .whl)
#   tools/gpu_session.sh kernels-1gpu  # 1 GPU (~4 min): every residual-norm kernel test on simulated ranks (one-shot,
#                                      # two-shot, FP8 epilogue, LayerNorm backward), fused single-GPU ops, FP8, norms bench
#   tools/gpu_session.sh single    # 1 GPU: kernels (simulated ranks), fused ops, grouped GEMM
#   tools/gpu_session.sh grouped   # 1 GPU: grouped-GEMM tests, bench/grouped.py, bench/grouped_tune.py (~4 min)
#   tools/gpu_session.sh multi-tests   # 2-4 GPUs: NCCL tests at world 2 and 4
#   tools/gpu_session.sh multi-bench   # 2-4 GPUs: allreduce+norm and overlap benchmarks
#   tools/gpu_session.sh overlap       # 2-4 GPUs: overlap + graphed-block tests, overlap benchmark
#   tools/gpu_session.sh graphed-push  # 2-4 GPUs: graphed-block tests, copy-engine push bandwidth
#   tools/gpu_session.sh compile-backend  # 2-4 GPUs: the torch.compile backend's test and bench/model.py
#   tools/gpu_session.sh model-final   # 2 GPUs (~8 min): bench/model.py's key cases (train-tp, train-sp, decode;
#                                      # FP8 and unmerged variants), then the compile-backend, compile FP8/MoE,
#                                      # peer-kernel and Lamport-kernel GPU tests
#   tools/gpu_session.sh model-s6      # 2 GPUs (~9 min): the session-6 model table (train-tp/sp, decode, FP8,
#                                      # unmerged), then the compile-backend and compile FP8/MoE GPU tests
#   tools/gpu_session.sh s7-model      # 2 GPUs (~8 min): compile-backend GPU tests, train-tp FP8 profiled
#                                      # (kernel tables + host profiles, torchao column from .thirdparty/wheels),
#                                      # train-sp at batch 1 and 4 with FP8
#   tools/gpu_session.sh s7-final      # 2 GPUs (~7 min): compile FP8/MoE and Lamport NCCL tests, train-tp FP8
#                                      # profiled (torchao column), train-sp at batch 4
#   tools/gpu_session.sh s8-next       # 2 GPUs (~9 min): session 7's open questions (Lamport NCCL test, FP8
#                                      # in the model, train-sp batch 4 with the batch > 1 fusions forced on)
#   tools/gpu_session.sh s8-measure    # 2 GPUs (~9 min): issue 27's unmeasured rows: MoE bench, the FP8 loss
#                                      # check on a GPU, train-sp FP8 profiled, train-tp FP8 at 8192 tokens
#   tools/gpu_session.sh s8-world4     # 4 GPUs (~9 min): Lamport NCCL test at world 4, all-reduce + norm bench
#                                      # at world 2 and 4 (FlashInfer column), world-4 compile/residual-norm tests
#   tools/gpu_session.sh s8-verify     # 2 GPUs (~5 min): the session-8 crossover table at work (NCCL tests,
#                                      # all-reduce + norm bench, a sweep whose auto column is the new table)
#   tools/gpu_session.sh s9-next       # 2 GPUs (~8 min): GPU checks of session 8's CPU-only changes (SP batch > 1
#                                      # fusions, FP8 MoE under Inductor, per-GPU table), MoE bench, train-sp batch 4
#   tools/gpu_session.sh s9-diag       # 2 GPUs (~8 min): train-sp (batch 1, 4) and train-tp next to opfuse without
#                                      # its rules / overlap schedule / add+norm / merged projections
#   tools/gpu_session.sh s9-aa         # 2 GPUs (~7 min): train-tp (+FP8, torchao) and train-sp with an A/A control,
#                                      # order rotated every round
#   tools/gpu_session.sh s9-isolated   # 2 GPUs (~4.5 min): train-sp / train-tp with each variant alone in a process
#   tools/gpu_session.sh isolated-bf16 # 2 GPUs (~9 min): train-tp, train-sp batch 4, each variant alone in a process
#   tools/gpu_session.sh isolated-fp8  # 2 GPUs (~9 min): opfuse FP8 vs torchao float8 and vs compile bf16, same way
#   tools/gpu_session.sh s10-next      # 2 GPUs (~8 min): which fusion of "SP batch > 1 + async TP" gives wrong
#                                      # gradients (tools/sp_async_tp_bisect.py), compile-backend test, train-tp autocast
#   tools/gpu_session.sh s10-isolated  # 2 GPUs (~5 min): train-tp, each variant alone in its own process (A B B A)
#   tools/gpu_session.sh s11-next      # 2 GPUs (~9 min): the SP batch > 1 + async TP bisect, train-tp isolated A B B A
#   tools/gpu_session.sh s11-sp        # 2 GPUs (~7.5 min): compile-backend test, train-sp batch 4 isolated A B B A
#   tools/gpu_session.sh s15-fp8-graphs  # 2 GPUs (~9 min): opfuse FP8 under CUDA graphs vs compile bf16, train-sp
#                                      # 2048, isolated A B B A after a warm-up run
#   tools/gpu_session.sh s17-dtensor-order # 2 GPUs (~3 min): DTensor graphs without peak-memory reordering: FP8 graphs
#                                      # and bf16 train-sp single runs, kernel tables with the NCCL-overlap view
#   tools/gpu_session.sh s18-bf16-tp   # 2 GPUs (~6 min): bf16 train-tp 2048, opfuse vs compile, isolated A B B A
#   tools/gpu_session.sh s18-moe-wgrad # 1 GPU (~4.5 min): FP8 grouped wgrad: grouped FP8 GPU tests, bench/moe.py --fp8
#   tools/gpu_session.sh s19-moe       # 1 GPU (~6 min): GPU tests of the pow2 stack quantizer, FP8 MoE bf16/FP8 wgrad/pow2
#   tools/gpu_session.sh s19-moe-gather # 1 GPU (~5.5 min): gathers instead of index_add in the MoE rewrite, one-read
#                                      # per-row quantizer: GPU tests, FP8 MoE bench profiled
#   tools/gpu_session.sh s19-fp8-sp    # 2 GPUs (~7 min): FP8 world-2 GPU tests, FP8 pow2 train-sp graphs A B B A
#   tools/gpu_session.sh s19-fp8-rs    # 2 GPUs (~8 min): FP8 train-sp graphs, p2p_overlap FP8 reduce-scatter vs nccl, A B B A
#   tools/gpu_session.sh s21-single    # 1 GPU (~4 min): single-GPU fused ops (autocast linears), FP8/MoE compile tests
#   tools/gpu_session.sh s22-gather-ab # 2 GPUs (~6 min): FP8 train-sp 2048 with / without the p2p gradient gathers, A B B A
#   tools/gpu_session.sh s22-gather-bf16 # 2 GPUs (~7 min): the same in bf16
#   tools/gpu_session.sh s21-gather    # 2 GPUs (~4 min): gradient all-gathers over peer memory: GPU tests, the gather
#                                      # alone vs NCCL per size, one FP8 train-sp step profiled
#   tools/gpu_session.sh s21-carveout  # 2 GPUs (~9.5 min): FP8 train-sp with the GEMMs under the backward gathers leaving
#                                      # 16 SMs to NCCL: profile, then A B B A against without
#   tools/gpu_session.sh s21-priority  # 2 GPUs (~4 min): the same step profiled with a high-priority NCCL stream, and
#                                      # with an 8-SM carveout
#   tools/gpu_session.sh s20-fp8-sp    # 2 GPUs (~9 min): FP8 pow2 train-sp 2048 under graphs vs compile bf16, A B B A
#   tools/gpu_session.sh s20-fp8-sp8192 # 2 GPUs (~7 min): the same at 8192 tokens (no warm-up run)
#   tools/gpu_session.sh s27-launch    # 1-2 GPUs (~8 min): cached Triton launches: host cost, the FP8 step with / without
#   tools/gpu_session.sh s27-launch-tests # 1 GPU (~6 min): the GPU tests of the kernels launched that way
#   tools/gpu_session.sh s27-x2        # 2 GPUs (~7 min): the small model at world 2; FP8 train-tp/sp 2048/8192 at world 2
#   tools/gpu_session.sh s28-ar        # 2 GPUs (~4 min): one-shot protocol tests, quick table (FlashInfer), timeline,
#                                      # crossover sweep at world 2 and the table fitted from it
#   tools/gpu_session.sh s28-fp8-rs    # 2 GPUs (~4 min): FP8 train-sp, reduce-scatter over peer memory vs NCCL
#   tools/gpu_session.sh s28-train     # 2 GPUs (~2 min): kernel tests (simulated ranks), train-tp/sp 2048 kernel tables
#   tools/gpu_session.sh s28-clocks    # 2 GPUs (~1 min): SM clock and power while train-tp 2048 is timed
#   tools/gpu_session.sh s28-host      # 1 GPU (~1 min): cached vs Triton launches, A B B A medians
#   tools/gpu_session.sh s29-fp8-aten  # 1 GPU (~9 min): FP8 norm + quantize as aten ops without CUDA graphs:
#                                      # compile FP8 GPU tests, 16-layer FP8 train-tp 2048 with and without
#   tools/gpu_session.sh s20-chunked-ar # 2 GPUs (~9 min): train-tp 8192 with the chunked GEMM + all-reduce vs without, A B B A
#   tools/gpu_session.sh s19-wgrad-sweep # 1 GPU (~5 min): FP8 vs bf16 grouped wgrad over 2048-16384 tokens, profiled
#   tools/gpu_session.sh s19-fp8-dist  # 2 GPUs (~1.5 min): tests/gpu/test_fp8_dist.py (FSDP grouped FP8 wgrad, world 2)
#   tools/gpu_session.sh s17-moe-fp8   # 1 GPU (~5 min): FP8 MoE: stack quantizer + grouped FP8 tests, bench/moe.py --fp8
#                                      # --profile (kernel table per variant); rerun it for the forward's W.T kept
#                                      # for its backward (written after session 17's device time was spent)
#   tools/gpu_session.sh s17-fp8-gather # 2 GPUs (~9.5 min): GPU tests, FP8 train-sp graphs A B B A with FP8 gathers
#   tools/gpu_session.sh s16-gpu-tests # 1 GPU (~1 min): tests/gpu/test_sm_carveout.py (not yet run on a GPU)
#   tools/gpu_session.sh s16-carveout  # 2 GPUs (~8 min): FP8 train-sp under graphs: as is, NCCL priority, SM carveout
#   tools/gpu_session.sh s16-carveout2 # 2 GPUs (~6 min): the same leaving 16, 8 and 32 SMs
#   tools/gpu_session.sh s16-bf16-sp   # 2 GPUs (~8 min): bf16 train-sp 2048, opfuse vs compile, isolated A B B A
#   tools/gpu_session.sh s16-nccl-priority  # 2 GPUs (~9.5 min): s15-overlap with TORCH_NCCL_HIGH_PRIORITY=1 (the
#                                      # collectives left to NCCL under the GEMMs of a CUDA graph?)
#   tools/gpu_session.sh s15-overlap   # 2 GPUs (~9.5 min): FP8 train-sp under CUDA graphs with the backward reduce-
#                                      # scatters and forward weight casts overlapped: kernel table, then A B B A
#   tools/gpu_session.sh s15-fp8-rs    # 2 GPUs (~8 min): FP8 reduce-scatter over peer memory: world-2 tests
#                                      # (forced), FP8 train-sp 2048 under CUDA graphs with it and without
#   tools/gpu_session.sh s14-graphs    # 2 GPUs (~9 min): FP8 compile GPU tests, FP8 pow2 train-sp 2048 beside
#                                      # compile/opfuse bf16, without and with CUDA graphs (--train-mode)
#   tools/gpu_session.sh s14-graphs2   # 2 GPUs (~6 min): training under CUDA graphs, which variant fails and why;
#                                      # opfuse FP8 train-sp kernel table and host profile
#   tools/gpu_session.sh s14-graphs3   # 2 GPUs (~9.5 min): graph-pool tests; train-sp 2048 with and without CUDA
#                                      # graphs: opfuse FP8 and compile bf16, each alone
#   tools/gpu_session.sh s14-fp8-sp    # 2 GPUs (~9.5 min): FP8 pow2 train-sp 2048 isolated A B B A after a warm-up run
#   tools/gpu_session.sh s13-fp8-sp    # 2 GPUs (~8 min): FP8 GPU training test (float64 check), FP8 pow2 train-sp
#                                      # 2048 isolated against compile bf16
#   tools/gpu_session.sh s13-next      # 2 GPUs (~9.5 min): session 12's unchecked pow2 GPU tests, train-sp batch 4
#                                      # isolated with a warm-up run
#   tools/gpu_session.sh s12-fp8       # 2 GPUs (~8 min): pow2 weight scales: GPU tests, quantizer bench, vs torchao
#   tools/gpu_session.sh s12-fp8-compile  # 2 GPUs (~6 min): opfuse FP8 (pow2 weights) vs torch.compile bf16
#   tools/gpu_session.sh s12-next      # 2 GPUs (~9 min): train-sp batch 4 isolated A B B A (scatter fusion + async TP)
#   tools/gpu_session.sh model-timeline  # 2 GPUs (~7 min): train-tp/train-sp kernel tables + one step's host and
#                                      # device timeline (idle gaps by cause), then the residual-norm/Lamport tests
#   tools/gpu_session.sh world8        # 8 GPUs: the world-8 tests
#   tools/gpu_session.sh world8-bench  # 8 GPUs: the world-8 benchmarks
#   tools/gpu_session.sh allreduce     # 2-4 GPUs (~7 min on 4x H200): all-reduce+norm bench with the FlashInfer
#                                      # column and floors (world 2, 4; hidden 8192, 5120), then the dispatch
#                                      # crossover sweep (world 2, 3, 4) and the table fitted from it
#                                      # (allreduce-bench ~4.5 min / allreduce-crossover ~3 min, build included)
#                                      # FlashInfer needs .thirdparty/ (tools/fetch_flashinfer.py) carried along
#   tools/gpu_session.sh oneshot       # 2 GPUs (~3 min): the one-shot's protocol tests (simulated ranks, graph
#                                      # replays), bounded waits, world-2 NCCL tests, then the all-reduce+norm
#                                      # bench at world 2 without FlashInfer (allreduce-bench has that column)
#   tools/gpu_session.sh nvidia-libs   # 1-2 GPUs: cuDNN frontend + cuBLASMp implementations (the
#                                      # wheels carried in .whl/ are installed first), tests + bench
#   tools/gpu_session.sh layernorm-backward  # 1 GPU (~2 min, build included): the norm backward kernels' tests
#                                      # (raw kernels, the family's backward, programs) and the norms bench
#                                      # (floor, cuda, compiled; cudnn when its wheel is installed)
#   tools/gpu_session.sh fp8           # 1+ GPU (sm90): FP8 tests and benchmark at world 1
#   tools/gpu_session.sh fp8-multi     # 2 GPUs: FP8 NCCL tests and benchmark at world 2
#   tools/gpu_session.sh fp8-allreduce # 1-2 GPUs (~3 min): the FP8 epilogue of the all-reduce + norm kernels
#                                      # (simulated ranks), the world-2 block test and bench/fp8.py --quick
#                                      # at world 2 (the last two need 2 GPUs)
#   tools/gpu_session.sh ar-bandwidth  # 2 GPUs, one device call (<= ~8.5 min, build included; issue 30): the
#                                      # pipelined Lamport two-shot and PDL tests (simulated ranks, then world 2
#                                      # over NCCL), bench/allreduce_norm.py --quick (FlashInfer column when
#                                      # .thirdparty/ is carried and its check passes), the Lamport kernel's
#                                      # bounded-wait test; every step's time limit shrinks to fit a 520 s budget
#   tools/gpu_session.sh s22-ar-small  # 2 GPUs (~9.5 min; issue 30): per-block call state tests, quick bench at 1-256
#                                      # tokens new vs previous kernels (.baseline/), the one-shot's phase timeline
#   tools/gpu_session.sh s22-ar-next   # 2 GPUs (~9 min; issue 30): protocol tests, quick table, one-shot timeline over
#                                      # push sizes, decode with / without PDL (profiled)
#   tools/gpu_session.sh s22-ar-1gpu   # 1 GPU (~2 min; issue 30): the one-shot's protocol tests, both poll depths
#   tools/gpu_session.sh s22-sim       # 1 GPU (~3 min; issue 30): simulated-rank timings, previous main vs this tree
#   tools/gpu_session.sh s22-sim-timeline # 1 GPU (~1.5 min; issue 30): simulated-rank one-shot phase timelines
#   tools/gpu_session.sh s23-gqa       # 1 GPU (~6 min; issue 26): decode attention over the unrepeated cache, world 1
#   tools/gpu_session.sh s23-decode-attention # 1 GPU (~4 min; issue 26): Triton decode attention vs fold vs repeat
#   tools/gpu_session.sh s23-final     # 1 GPU (~3 min; issue 30): final kernels' tests, split vs whole rows, PDL off/on
#   tools/gpu_session.sh s24-fp8-profile # 1 GPU (~3 min): GQA GPU tests, FP8 pow2 train-tp 2048 kernel tables at world 1
#   tools/gpu_session.sh s24-attention # 1 GPU (~3 min): decode_attention's new kernels: GPU tests, decode 1/8/64 profiled
#   tools/gpu_session.sh s26-fp8-batch # 1 GPU (~6 min): FP8 quantizer GPU tests; 16-layer FP8 train-tp, casts batched or not
#   tools/gpu_session.sh s26-fp8-graphs # 1 GPU (~7 min): the same under CUDA graphs; 2-layer hidden-8192 FP8 train-tp
#   tools/gpu_session.sh s26-host-cost # 1 GPU (~1 min): host us per call of mm vs _scaled_mm, one vs batched weight casts
#   tools/gpu_session.sh s26-fp8-profile # 1 GPU (~3 min): 16-layer FP8 train-tp alone, host profile (cProfile + aten ops)
#   tools/gpu_session.sh s26-small2    # 2 GPUs (~4 min): 16-layer model at world 2: decode (host read or not), train-tp/sp 2048
#   tools/gpu_session.sh s25-final     # 1 GPU (~5.5 min): compile GPU tests; 16-layer train-tp; 2-layer decode 1/8
#   tools/gpu_session.sh s25-small-train # 1 GPU (~9 min): 16-layer train-tp 2048: variants without each fusion; FP8 under graphs
#   tools/gpu_session.sh s25-host2     # 1 GPU (~5 min): compile-path GPU tests; 16-layer decode (host read, merged or not)
#   tools/gpu_session.sh s25-fp8-small # 1 GPU (~5 min): FP8 pow2 train-tp on the 16-layer model, profiled
#   tools/gpu_session.sh s25-host      # 1 GPU (~8 min): 16-layer small model decode (host read per token or not), vs main before
#                                      # the cheap packed-parameter check; FP8 train-tp small
#   tools/gpu_session.sh s24-decode-profile # 1 GPU (~2 min): decode batch 1 / 8 kernel tables at world 1
#   tools/gpu_session.sh s24-table     # 2 GPUs (~6 min; 1 GPU: world 1): bench/model.py's full default table, timed
#   tools/gpu_session.sh s24-gqa-auto  # 1 GPU (~5 min): decode_attention as auto: GQA tests, decode 64 / 1 world 1
#   tools/gpu_session.sh s24-1gpu      # 1 GPU (~6 min): kernel tests on the final C++, GQA tests, decode 1/8/64 repeat/fold/decode_attention
#   tools/gpu_session.sh s23-split     # 1 GPU (~3 min; issue 30): one-shot rows split over clusters vs whole rows
#   tools/gpu_session.sh s23-sim-stamps # 1 GPU (~1.5 min; issue 30): the one-shot's row epilogue, stamped
#   tools/gpu_session.sh s22-ar-clear  # 2 GPUs (~6.5 min; issue 30): clear-on-read one-shot, poll depth 1 vs 2: NCCL
#                                      # tests, quick tables, timeline
#   tools/gpu_session.sh STAGE -k EXPR   # extra args go to pytest
#   DRY=1 tools/gpu_session.sh STAGE     # print the steps a stage would run, run none (no GPU needed)
set -uo pipefail
stage=${1:-single}; shift || true
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Prebuilt modules: the build step takes ~110 s of device time on a fresh machine. Built here instead
# (no GPU needed: `PYTHONPATH=. OPFUSE_CACHE_DIR=$PWD/.opfuse-cache python3 -m opfuse.runtime.extension
# --python <a Python of the GPU host's version, with pybind11>`), carried (carry: .opfuse-cache) and
# named by OPFUSE_CACHE_DIR=$PWD/.opfuse-cache on the device, the build step only finds them.
export OPFUSE_CACHE_DIR=${OPFUSE_CACHE_DIR:-/tmp/opfuse-cache}
# The device tool returns only a few files from $OUT: logs and JSON go to a local folder, packed
# into $OUT/logs.tgz after every step (a call cut off at its time limit still returns what ran).
RESULTS=${OUT:-/tmp/opfuse-out}; mkdir -p "$RESULTS"
OUT=/tmp/opfuse-logs; rm -rf "$OUT"; mkdir -p "$OUT"
pack() { tar -czf "$RESULTS/logs.tgz" -C "$OUT" . 2>/dev/null; }
summary=()
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  if [ -n "${DRY:-}" ]; then echo "step $name $limit PYTHONPATH=$PYTHONPATH $*"; return 0; fi
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E '(passed|failed|error)' "$OUT/$name.log" | tail -1)")")
  printf '%s\n' "${summary[@]}" > "$OUT/summary.txt"
  pack
  return 0
}
# Wheels carried in .whl/ (nvidia-cudnn-frontend, nvidia-cublasmp-cu13; --no-deps: the frontend's
# cutlass-dsl / tvm-ffi dependencies serve only Blackwell kernels) into /tmp/site; false if none.
install_wheels() {
  ls .whl/*.whl >/dev/null 2>&1 || return 1
  [ -n "${DRY:-}" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > "$OUT/wheels.log" 2>&1 || echo "wheel install failed (see wheels.log)"
}
# Baseline libraries for the benches only (torchao float8: bench/model.py's "torchao fp8" column),
# carried in .thirdparty/wheels/ (pip download --no-deps torchao==0.18.0 -d .thirdparty/wheels):
# installed into /tmp/site-bench, which the bench steps that use them put on PYTHONPATH.
install_bench_wheels() {
  ls .thirdparty/wheels/*.whl >/dev/null 2>&1 || { echo "no wheels in .thirdparty/wheels/"; return 1; }
  [ -n "${DRY:-}" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-bench \
    .thirdparty/wheels/*.whl > "$OUT/bench_wheels.log" 2>&1 || echo "bench wheel install failed (see bench_wheels.log)"
}
# Budgeted stages set END (seconds after the script started, the build included); each step then
# gets min(its own limit, what is left after the reserves of the steps that come later), at least 30 s.
fits() {  # fits LIMIT RESERVE: min(LIMIT, END - RESERVE - now), at least 30
  local left=$((END - $2 - SECONDS)); [ "$left" -lt 30 ] && left=30
  echo $(( $1 < left ? $1 : left ))
}
EXTRA=("$@")  # extra pytest arguments (STAGE -k EXPR)
tests() {  # tests NAME TIMEOUT PYTEST-ARGS...: a pytest step with the stage's extra arguments
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m pytest "$@" "${EXTRA[@]}"
}
# A wrong FlashInfer workspace would hang its kernel: check it on small shapes first (bounded), and
# leave its column out of the benchmark unless the check passed.
allreduce_vs_flashinfer() {  # allreduce_vs_flashinfer CHECK-LIMIT CHECK-TIMEOUT BENCH-LIMIT WORLD...
  local check_limit=$1 check_timeout=$2 bench_limit=$3; shift 3
  step flashinfer_check "$check_limit" python3 bench/flashinfer_ar/check.py --world "$@" --timeout "$check_timeout"
  local fi_flag=--no-flashinfer
  grep -q "flashinfer check passed" "$OUT/flashinfer_check.log" 2>/dev/null && fi_flag=
  step allreduce_bench "$bench_limit" python3 bench/allreduce_norm.py --world "$@" --hidden 8192 5120 \
    --tokens 1 64 256 1024 4096 8192 --json "$OUT/allreduce_norm.json" $fi_flag
}
flashinfer_checked() {  # flashinfer_checked RESERVE: the world-2 check of the FlashInfer binding (carried
  # in .thirdparty); sets fi_flag for bench/allreduce_norm.py: empty when it passed, else --no-flashinfer.
  fi_flag=--no-flashinfer
  [ -d .thirdparty/flashinfer ] || return 0
  step flashinfer_check "$(fits 60 "$1")" python3 bench/flashinfer_ar/check.py --world 2 --timeout 45
  grep -q "flashinfer check passed" "$OUT/flashinfer_check.log" 2>/dev/null && fi_flag=
  return 0
}
crossover_sweep() {  # crossover_sweep SWEEP-LIMIT TABLE-LIMIT WORLD...
  local limit=$1 table_limit=$2; shift 2
  step crossover_sweep "$limit" python3 bench/allreduce_crossover.py --world "$@" --json "$OUT/allreduce_crossover.json"
  # The fitted table goes to $OUT for review; copy it to opfuse/families/residual_norm/ to ship it.
  step crossover_table "$table_limit" python3 tools/crossover_table.py "$OUT/allreduce_crossover.json" --out "$OUT/crossovers.json"
}
model_lines() {  # model_lines LOG...: bench/model.py's result lines (rows, tables, errors, notes) of each log
  local name
  for name in "$@"; do
    echo "=== $name"
    grep -E "^(\[|\||relative error|note: (train|torchao|--fp8|async))" "$OUT/$name.log" 2>/dev/null | grep -v "^|---" | cut -c1-600
  done
}
show() {  # show LOG...: the summary part of each bench log that exists
  local name
  for name in "$@"; do
    [ -f "$OUT/$name.log" ] || continue
    echo "=== $name"
    case "$name" in
      grouped_bench) sed -n '/^HBM bandwidth/p; /^summary/,$p' "$OUT/$name.log" ;;
      grouped_tune) sed -n '/^=== tuning-table/,$p' "$OUT/$name.log" ;;
      crossover_sweep) sed -n '/^summary: automatic/,$p' "$OUT/$name.log" ;;
      crossover_table) cat "$OUT/$name.log" ;;
      nvidia_bench) grep -E "^(note:|library:|cudnn faster|cublasmp faster)" "$OUT/$name.log" ;;
      norms_bench) sed -n '/^Add + norm/,/^cudnn faster/p' "$OUT/$name.log"; grep -E "^note:" "$OUT/$name.log" | head -5 ;;
      *) sed -n '/^summary/,$p' "$OUT/$name.log" ;;
    esac
  done
}
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,driver_version --format=csv > "$OUT/gpus.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'triton', triton.__version__)" >> "$OUT/gpus.txt" 2>&1
# The grouped GEMM is Triton and torch only: its stage skips the extension build.
[ "$stage" = grouped ] || step build 300 python3 -m opfuse.runtime.extension --build
case "$stage" in
  validate-multi)
    tests kernels 240 -x -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fused_single_gpu.py
    tests residual_norm_dist 200 -x -q tests/gpu/test_residual_norm_dist.py
    tests peer_timeout 120 -x -q tests/gpu/test_peer_timeout.py
    tests overlap_tests 200 -x -q tests/gpu/test_overlap.py
    tests graphed_tests 200 -x -q tests/gpu/test_graphed.py
    tests horizontal_tests 150 -x -q tests/gpu/test_horizontal.py
    ;;
  correctness)
    tests kernels 240 -x -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fused_single_gpu.py
    tests peer_timeout 120 -x -q tests/gpu/test_peer_timeout.py
    tests residual_norm_dist 200 -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    step host_overhead 120 python3 bench/host_overhead.py --device cuda --calls 2000
    ;;
  validate)
    tests kernels 240 -x -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fused_single_gpu.py
    tests grouped_tests 240 -x -q tests/gpu/test_grouped.py
    tests residual_norm_dist 200 -x -q tests/gpu/test_residual_norm_dist.py
    tests peer_timeout 120 -x -q tests/gpu/test_peer_timeout.py
    tests overlap_tests 200 -x -q tests/gpu/test_overlap.py
    tests graphed_tests 200 -x -q tests/gpu/test_graphed.py
    tests horizontal_tests 150 -x -q tests/gpu/test_horizontal.py
    tests fp8_tests 300 -x -q tests/gpu/test_fp8.py tests/gpu/test_fp8_dist.py
    tests compile_backend_tests 300 -x -q tests/gpu/test_compile_backend.py
    ;;
  one-gpu)
    tests kernels 240 -x -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fused_single_gpu.py
    tests grouped_tests 200 -q --maxfail=10 tests/gpu/test_grouped.py
    step grouped_bench 100 python3 bench/grouped.py
    step grouped_tune 150 python3 bench/grouped_tune.py --reps 5 --json "$OUT/grouped_tune.json"
    tests horizontal_tests 150 -x -q tests/gpu/test_horizontal.py
    tests fp8_tests 200 -x -q tests/gpu/test_fp8.py
    step fp8_bench 150 python3 bench/fp8.py --world 1 --json "$OUT/fp8_w1.json"
    step host_overhead 120 python3 bench/host_overhead.py --device cuda --calls 2000
    if install_wheels; then
      PYTHONPATH=.:/tmp/site OPFUSE_EXPECT_NVIDIA_LIBS=1 step doctor 90 python3 -m opfuse doctor
      PYTHONPATH=.:/tmp/site OPFUSE_EXPECT_NVIDIA_LIBS=1 tests nvidia_tests 200 -q -rs tests/gpu/test_nvidia_libs.py
      PYTHONPATH=.:/tmp/site step nvidia_bench 150 python3 bench/nvidia_libs.py --part norms grouped epilogue --tokens 1 128 2048 8192 \
        --json "$OUT/nvidia_libs_w1.json"
    fi
    final_summary() {
      show grouped_bench grouped_tune
      echo "=== host overhead"; tail -15 "$OUT/host_overhead.log"
      echo "=== fp8"; tail -12 "$OUT/fp8_bench.log"
      show nvidia_bench
    }
    ;;
  x2-tests)
    # Most valuable first: a call cut at its time limit still returns the steps that ran.
    install_wheels
    tests residual_norm_dist 200 -x -q tests/gpu/test_residual_norm_dist.py
    tests peer_timeout 120 -x -q tests/gpu/test_peer_timeout.py
    tests fp8_ar_dist 150 -x -q tests/gpu/test_fp8_allreduce_norm_dist.py
    tests compile_backend_tests 300 -x -q tests/gpu/test_compile_backend.py
    tests fp8_dist_tests 150 -x -q tests/gpu/test_fp8_dist.py
    tests graphed_tests 150 -x -q tests/gpu/test_graphed.py
    tests overlap_tests 150 -x -q tests/gpu/test_overlap.py
    tests horizontal_tests 100 -x -q tests/gpu/test_horizontal.py
    PYTHONPATH=.:/tmp/site OPFUSE_EXPECT_NVIDIA_LIBS=1 tests nvidia_tests 150 -q -rs tests/gpu/test_nvidia_libs.py
    step grouped_bench 80 python3 bench/grouped.py
    step grouped_tune 100 python3 bench/grouped_tune.py --reps 5 --json "$OUT/grouped_tune.json"
    final_summary() { show grouped_bench grouped_tune; }
    ;;
  x2-final)
    # The re-run after fixes, most valuable first (a call cut by the device budget keeps what ran).
    tests residual_norm_dist 200 -x -q tests/gpu/test_residual_norm_dist.py
    tests peer_timeout 120 -x -q tests/gpu/test_peer_timeout.py
    tests fp8_ar_dist 150 -x -q tests/gpu/test_fp8_allreduce_norm_dist.py
    allreduce_vs_flashinfer 80 60 200 2
    step block_bench 150 python3 bench/block.py --world 2 --json "$OUT/block.json"
    tests compile_backend_tests 300 -x -q tests/gpu/test_compile_backend.py
    tests fp8_dist_tests 150 -x -q tests/gpu/test_fp8_dist.py
    tests graphed_tests 150 -x -q tests/gpu/test_graphed.py
    step model_bench 240 python3 bench/model.py --world 2 --decode 1 --train 2048 --json "$OUT/model.json"
    final_summary() { show allreduce_bench block_bench model_bench; }
    ;;
  x2-bench)
    install_wheels
    step flashinfer_build 120 python3 bench/flashinfer_ar/build.py
    allreduce_vs_flashinfer 80 60 200 2
    step block_bench 150 python3 bench/block.py --world 2 --json "$OUT/block.json"
    step model_bench 240 python3 bench/model.py --world 2 --decode 1 64 --train 2048 --json "$OUT/model.json"
    crossover_sweep 120 30 2
    PYTHONPATH=.:/tmp/site step nvidia_bench 90 python3 bench/nvidia_libs.py --part cublasmp --world 2 --m 512 2048 8192 \
      --json "$OUT/nvidia_libs_w2.json"
    final_summary() { show allreduce_bench block_bench model_bench crossover_sweep crossover_table nvidia_bench; }
    ;;
  single)
    tests kernels 400 -x -q tests/gpu/test_residual_norm_kernels.py
    tests fused_single 300 -x -q tests/gpu/test_fused_single_gpu.py
    tests grouped_tests 300 -x -q tests/gpu/test_grouped*.py
    step grouped_bench 240 python3 bench/grouped.py
    tests horizontal_tests 150 -x -q tests/gpu/test_horizontal.py
    step horizontal_bench 150 python3 bench/horizontal.py
    ;;
  grouped)
    tests grouped_tests 200 -q --maxfail=10 tests/gpu/test_grouped.py
    step grouped_bench 100 python3 bench/grouped.py
    step grouped_tune 150 python3 bench/grouped_tune.py --reps 5 --json "$OUT/grouped_tune.json"
    final_summary() { show grouped_bench grouped_tune; }
    ;;
  multi-tests)
    tests kernels 120 -x -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fused_single_gpu.py
    tests residual_norm_dist 200 -x -q tests/gpu/test_residual_norm_dist.py
    tests peer_timeout 120 -x -q tests/gpu/test_peer_timeout.py
    tests overlap_tests 120 -x -q tests/gpu/test_overlap*.py
    tests graphed_tests 150 -x -q tests/gpu/test_graphed.py
    tests horizontal_tests 150 -x -q tests/gpu/test_horizontal.py
    ;;
  multi-bench)
    step allreduce_bench 300 python3 bench/allreduce_norm.py --world 2 4 --json "$OUT/allreduce_norm.json"
    step overlap_bench 100 python3 bench/overlap.py --world 2 4
    step block_bench 280 python3 bench/block.py --world 2 4
    step block_swiglu_bench 280 python3 bench/block.py --world 2 4 --act swiglu
    ;;
  overlap)
    tests overlap_tests 400 -x -q tests/gpu/test_overlap.py
    tests graphed_tests 300 -x -q tests/gpu/test_graphed.py
    step overlap_bench 300 python3 bench/overlap.py --world 2 4 --m 512 2048 8192
    ;;
  graphed-push)
    tests graphed_tests 300 -x -q tests/gpu/test_graphed.py
    step push_bench 200 python3 bench/push_bandwidth.py --world 2 4
    ;;
  model-final)  # 2 GPUs (~8 min with the build): bench/model.py's key world-2 cases first (issue 26), then
                # the GPU tests of what session 5 changed (compile backend, peer kernels, Lamport kernel)
    step model_bench 260 python3 bench/model.py --world 2 --cases train-tp train-sp decode --train 2048 \
      --train-batch 1 --decode 1 --fp8 tensor --merge-ab --json "$OUT/model.json"
    tests compile_backend_tests 110 -x -q tests/gpu/test_compile_backend.py
    tests compile_fp8_moe_tests 80 -q --maxfail=3 tests/gpu/test_compile_fp8_moe.py
    tests residual_norm_dist 50 -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    tests lamport_kernels 50 -x -q --maxfail=3 tests/gpu/test_residual_norm_lamport.py
    final_summary() { echo "=== model_bench"; grep -E "^(\[|\|)" "$OUT/model_bench.log" | grep -v "^|---"; }
    ;;
  model-s6)  # 2 GPUs (~9 min with the build): session 6's table (issue 26/27): train-tp, train-sp, decode with
             # the FP8 and unmerged variants (steady-state training timing), then the compile-backend GPU tests
             # (the all-gather kept for the backward runs p2p_overlap there) and the compile FP8/MoE tests
    step model_bench 300 python3 bench/model.py --world 2 --cases train-tp train-sp decode --train 2048 \
      --train-batch 1 --decode 1 --fp8 tensor --merge-ab --json "$OUT/model.json"
    tests compile_backend_tests 130 -x -q tests/gpu/test_compile_backend.py
    tests compile_fp8_moe_tests 80 -q --maxfail=3 tests/gpu/test_compile_fp8_moe.py
    final_summary() { echo "=== model_bench"; grep -E "^(\[|\||note: (train|decode))" "$OUT/model_bench.log" | grep -v "^|---"; }
    ;;
  s7-model)  # 2 GPUs (~8 min with the build): the compile-backend GPU tests (DTensor SP at batch 2, kept
             # gathers), train-tp with FP8 profiled (kernel tables, timelines, host profiles; opfuse fp8 and
             # torchao fp8 beside bf16), then train-sp at batch 1 and 4 with FP8
    # S7_TESTS=0 skips the GPU tests (run once per session); S7_SP_BATCH picks train-sp's batches
    install_bench_wheels
    [ "${S7_TESTS:-1}" = 0 ] || tests compile_backend_tests 150 -x -q tests/gpu/test_compile_backend.py
    PYTHONPATH=.:/tmp/site-bench step model_tp_fp8 200 python3 bench/model.py --world 2 --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor --profile --json "$OUT/model_tp.json"
    # shellcheck disable=SC2086
    PYTHONPATH=.:/tmp/site-bench step model_sp 260 python3 bench/model.py --world 2 --cases train-sp --train 2048 \
      --train-batch ${S7_SP_BATCH:-1 4} --fp8 tensor --json "$OUT/model_sp.json"
    final_summary() {
      model_lines model_tp_fp8 model_sp
      echo "=== host profiles"; grep -A19 "^host profile" "$OUT/model_tp_fp8.log" | cut -c1-160
    }
    ;;
  s7-final)  # 2 GPUs (~7 min with the build): the compile FP8/MoE tests (FP8 linears as aten ops) and the
             # Lamport two-shot's NCCL tests (now chosen from 4 MiB at world 2), then train-tp with FP8
             # profiled (torchao column from .thirdparty/wheels) and train-sp at batch 4
    install_bench_wheels
    tests compile_fp8_moe_tests 90 -q --maxfail=3 tests/gpu/test_compile_fp8_moe.py
    tests lamport_dist 90 -x -q tests/gpu/test_residual_norm_lamport_dist.py -k "2]"
    PYTHONPATH=.:/tmp/site-bench step model_tp_fp8 180 python3 bench/model.py --world 2 --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor --profile --json "$OUT/model_tp.json"
    step model_sp 130 python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 4 \
      --json "$OUT/model_sp.json"
    final_summary() {
      model_lines model_tp_fp8 model_sp
      echo "=== host profiles"; grep -A8 "^host profile" "$OUT/model_tp_fp8.log" | cut -c1-160
    }
    ;;
  s8-next)  # 2 GPUs (~9 min with the build): what session 7 left open, in one call: the Lamport NCCL test in
            # full, the compile FP8/MoE tests, train-tp bf16 + FP8 (the Lamport all-reduce and one weight
            # quantization per step in the model; torchao column), then train-sp at batch 4 with the batch > 1
            # fusions forced on, with and without Inductor's async TP (which part gives wrong gradients)
    install_bench_wheels
    tests lamport_dist 120 -x -q tests/gpu/test_residual_norm_lamport_dist.py -k "2]"
    tests compile_fp8_moe_tests 90 -q --maxfail=3 tests/gpu/test_compile_fp8_moe.py
    PYTHONPATH=.:/tmp/site-bench step model_tp_fp8 170 python3 bench/model.py --world 2 --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor --json "$OUT/model_tp.json"
    step model_sp_diag 200 python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 4 \
      --variants opfuse:sp-batch-on opfuse:sp-batch-on-no-async-tp --json "$OUT/model_sp.json"
    final_summary() {
      model_lines model_tp_fp8 model_sp_diag
    }
    ;;
  s8-measure)  # 2 GPUs (~9 min; build it here first, see "Prebuilt modules" above): issue 27's unmeasured
               # rows: the Mixtral-style MoE bench (GPU 0) beside the 200-step FP8 loss check (GPU 1, untimed),
               # then train-sp with FP8 profiled (kernel tables: where SP loses to torch.compile) and train-tp
               # at 8192 tokens with FP8
    install_bench_wheels
    CUDA_VISIBLE_DEVICES=1 step loss_check 200 python3 tools/fp8_loss_check.py --device cuda --dtype bfloat16 &
    CUDA_VISIBLE_DEVICES=0 step moe_bench 230 python3 bench/moe.py --fp8 --json "$OUT/moe.json"
    wait
    PYTHONPATH=.:/tmp/site-bench step model_sp_fp8 200 python3 bench/model.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor --profile --json "$OUT/model_sp.json"
    PYTHONPATH=.:/tmp/site-bench step model_tp_8192 150 python3 bench/model.py --world 2 --cases train-tp --train 8192 \
      --train-batch 1 --fp8 tensor --json "$OUT/model_tp8192.json"
    final_summary() {
      echo "=== loss_check"; tail -4 "$OUT/loss_check.log"
      show moe_bench
      grep -E "^(\||relative|note)" "$OUT/moe_bench.log" | grep -v "^|---"
      model_lines model_sp_fp8 model_tp_8192
      sed -n '/GPU time per step by kernel category/,/first kernel start/p' "$OUT/model_sp_fp8.log"
      grep -A8 "^host profile" "$OUT/model_sp_fp8.log" | cut -c1-160
    }
    ;;
  s8-world4)  # 4 GPUs (~9 min; prebuilt modules): issue 30 at world 4 and world 2 on the host lent: the Lamport
              # protocol's NCCL test at world 4, the all-reduce + norm bench (FlashInfer column) at world 2 and
              # 4, then the compile backend's and the residual-norm kernels' world-4 tests
    END=${AR_BUDGET_S:-540}
    tests lamport_dist "$(fits 110 430)" -x -q tests/gpu/test_residual_norm_lamport_dist.py -k "4]"
    fi_flag=--no-flashinfer
    if [ -d .thirdparty/flashinfer ]; then
      step flashinfer_build "$(fits 90 390)" python3 bench/flashinfer_ar/build.py
      step flashinfer_check "$(fits 60 350)" python3 bench/flashinfer_ar/check.py --world 2 4 --timeout 45
      grep -q "flashinfer check passed" "$OUT/flashinfer_check.log" 2>/dev/null && fi_flag=
    fi
    step allreduce_quick "$(fits 150 260)" python3 bench/allreduce_norm.py --quick --world 2 4 \
      --json "$OUT/allreduce_quick.json" $fi_flag
    step crossover_sweep "$(fits 150 120)" python3 bench/allreduce_crossover.py --world 2 4 \
      --json "$OUT/allreduce_crossover.json"
    step crossover_table "$(fits 30 110)" python3 tools/crossover_table.py "$OUT/allreduce_crossover.json" \
      --out "$OUT/crossovers.json"
    tests compile_backend "$(fits 80 30)" -x -q tests/gpu/test_compile_backend.py -k "4]"
    tests residual_norm_dist "$(fits 60 0)" -x -q tests/gpu/test_residual_norm_dist.py -k "4]"
    final_summary() {
      echo "=== flashinfer"; tail -2 "$OUT/flashinfer_build.log" "$OUT/flashinfer_check.log" 2>/dev/null
      if grep -q "^summary" "$OUT/allreduce_quick.log" 2>/dev/null; then
        show allreduce_quick
      else
        echo "=== allreduce_quick (no summary: cut or failed)"; grep "tokens done" "$OUT/allreduce_quick.log" | tail -16
      fi
      show crossover_sweep crossover_table
    }
    ;;
  s8-verify)  # 2+ GPUs (~5 min; prebuilt modules): the crossover table fitted in session 8 at work: the
              # residual-norm and Lamport NCCL tests (automatic choice from the table), the all-reduce + norm
              # bench (FlashInfer column) and a crossover sweep whose "auto" column is the new table
    END=${AR_BUDGET_S:-430}
    tests lamport_dist "$(fits 80 340)" -x -q tests/gpu/test_residual_norm_lamport_dist.py -k "2]"
    tests residual_norm_dist "$(fits 60 200)" -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    fi_flag=--no-flashinfer
    if [ -d .thirdparty/flashinfer ]; then
      step flashinfer_build "$(fits 90 180)" python3 bench/flashinfer_ar/build.py
      step flashinfer_check "$(fits 60 150)" python3 bench/flashinfer_ar/check.py --world 2 --timeout 45
      grep -q "flashinfer check passed" "$OUT/flashinfer_check.log" 2>/dev/null && fi_flag=
    fi
    step allreduce_quick "$(fits 90 90)" python3 bench/allreduce_norm.py --quick --world 2 \
      --json "$OUT/allreduce_quick.json" $fi_flag
    step crossover_sweep "$(fits 90 60)" python3 bench/allreduce_crossover.py --world 2 \
      --json "$OUT/allreduce_crossover.json"
    step crossover_table "$(fits 30 50)" python3 tools/crossover_table.py "$OUT/allreduce_crossover.json" \
      --out "$OUT/crossovers.json"
    tests lamport_kernels "$(fits 60 100)" -q --maxfail=3 tests/gpu/test_residual_norm_lamport.py
    # the MoE bench with torch._grouped_mm forced (session 8 measured the automatic choice, Triton
    # persistent, at 1.03x torch.compile at 16384 tokens): does the choice explain it?
    OPFUSE_FORCE_IMPL=grouped_linear=torch_grouped_mm CUDA_VISIBLE_DEVICES=0 step moe_grouped_mm "$(fits 110 0)" \
      python3 bench/moe.py --json "$OUT/moe_grouped_mm.json"
    final_summary() {
      echo "=== flashinfer"; tail -2 "$OUT/flashinfer_build.log" "$OUT/flashinfer_check.log" 2>/dev/null
      show allreduce_quick crossover_sweep crossover_table
      grep -E "^(\\||relative|note)" "$OUT/moe_grouped_mm.log" 2>/dev/null | grep -v "^|---"
    }
    ;;
  s9-next)  # 2 GPUs (~8 min; prebuild the modules here first): what session 8 changed without a GPU run:
            # the compile backend test (SP batch > 1 fused without async TP, refused with it), the FP8 MoE
            # block under Inductor, the per-GPU crossover table in the NCCL tests, then the MoE bench (the
            # training choice of the grouped GEMM, the FP8 variant) and train-sp at batch 4
    install_bench_wheels
    tests compile_backend_tests 150 -x -q tests/gpu/test_compile_backend.py -k "2]"
    tests compile_fp8_moe_tests 90 -q --maxfail=3 tests/gpu/test_compile_fp8_moe.py
    tests lamport_dist 60 -x -q tests/gpu/test_residual_norm_lamport_dist.py -k "2]"
    tests residual_norm_dist 50 -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    CUDA_VISIBLE_DEVICES=0 step moe_bench 120 python3 bench/moe.py --fp8 --json "$OUT/moe.json"
    step model_sp_diag 160 python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 4 \
      --variants opfuse:sp-batch-on-no-async-tp --json "$OUT/model_sp.json"
    # where FP8 train-tp at 2048 tokens spends the time on H100 (0.82x measured, 0.73x predicted)
    PYTHONPATH=.:/tmp/site-bench step model_tp_fp8 150 python3 bench/model.py --world 2 --cases train-tp \
      --train 2048 --train-batch 1 --fp8 tensor --profile --json "$OUT/model_tp.json"
    final_summary() {
      grep -E "^(\\||relative|note)" "$OUT/moe_bench.log" 2>/dev/null | grep -v "^|---"
      model_lines model_sp_diag model_tp_fp8
      sed -n '/GPU time per step by kernel category/,/first kernel start/p' "$OUT/model_tp_fp8.log"
    }
    ;;
  s9-diag)  # 2 GPUs (~8 min): where opfuse loses to torch.compile (issue 26, "never slower"): train-sp at
            # batch 1 and 4 and train-tp, each next to opfuse with no rule applied (with and without the
            # all-reduce overlap schedule), without the standalone add + RMSNorm, without merged projections
    step model_sp_variants 360 python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 4 \
      --variants opfuse:no-fuse opfuse:no-fuse-no-overlap opfuse:no-norm --json "$OUT/model_sp.json"
    step model_tp_variants 180 python3 bench/model.py --world 2 --cases train-tp --train 2048 --train-batch 1 \
      --variants opfuse:no-fuse opfuse:no-merge --json "$OUT/model_tp.json"
    final_summary() { model_lines model_sp_variants model_tp_variants; }
    ;;
  s9-aa)  # 2 GPUs (~7 min): the model table with the variants' order rotated every round and an A/A control
          # (a second torch.compile model): train-tp 2048 with FP8 and torchao, train-sp 2048 at batch 1 and 4
    install_bench_wheels
    PYTHONPATH=.:/tmp/site-bench step model_tp_aa 200 python3 bench/model.py --world 2 --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor --variants compile:again opfuse:no-fuse --json "$OUT/model_tp.json"
    step model_sp_aa 300 python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 4 \
      --variants compile:again opfuse:no-fuse --json "$OUT/model_sp.json"
    final_summary() { model_lines model_tp_aa model_sp_aa; }
    ;;
  s9-isolated)  # 2 GPUs (~4.5 min): each variant alone in its own process (--only), A B B A, train-sp 2048
                # batch 1 then train-tp 2048: the comparison without another compiled model beside it
    i=0
    for variant in compile opfuse opfuse compile; do
      i=$((i + 1))
      step "sp_${i}_${variant}" 70 python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 \
        --only "$variant" --json "$OUT/sp_${i}.json"
    done
    for variant in compile opfuse; do
      step "tp_${variant}" 60 python3 bench/model.py --world 2 --cases train-tp --train 2048 --train-batch 1 \
        --only "$variant" --json "$OUT/tp_${variant}.json"
    done
    final_summary() { grep -h "^\[.*world 2" "$OUT"/sp_*.log "$OUT"/tp_*.log | cut -c1-200; }
    ;;
  isolated-bf16)  # 2 GPUs (~9 min): issue 26's training ratios with each variant alone in its own process
                  # (bench/model_isolated.py, A B B A): train-tp 2048 and train-sp 2048 at batch 4
    step isolated_tp 270 python3 bench/model_isolated.py --world 2 --cases train-tp --train 2048 --train-batch 1 \
      --run-timeout 90 --json "$OUT/isolated_tp.json"
    step isolated_sp_b4 290 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 --train-batch 4 \
      --run-timeout 90 --json "$OUT/isolated_sp_b4.json"
    final_summary() { grep -h -E "^(\||note)" "$OUT"/isolated_*.log | grep -v "^|---"; }
    ;;
  isolated-fp8)  # 2 GPUs (~9 min): issue 27's FP8 ratios the same way: opfuse FP8 against torchao float8, then
                 # against torch.compile bf16 (train-tp, 2048 tokens)
    install_bench_wheels
    PYTHONPATH=.:/tmp/site-bench step isolated_fp8_torchao 280 python3 bench/model_isolated.py --world 2 \
      --cases train-tp --train 2048 --train-batch 1 --fp8 tensor --pair "torchao fp8" "opfuse fp8" \
      --run-timeout 90 --json "$OUT/isolated_fp8_torchao.json"
    step isolated_fp8_compile 260 python3 bench/model_isolated.py --world 2 --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor --pair compile "opfuse fp8" --run-timeout 90 --json "$OUT/isolated_fp8_compile.json"
    final_summary() { grep -h -E "^(\||note)" "$OUT"/isolated_*.log | grep -v "^|---"; }
    ;;
  s10-next)  # 2 GPUs (~8 min; prebuilt modules): session 10 had no device time, so this is its GPU work: which
             # fusion of the pair "SP batch > 1 fusions + async TP" gives the wrong gradients
             # (tools/sp_async_tp_bisect.py), the compile-backend GPU test, then train-tp under autocast (float32
             # residual stream: the add + norm fusions the kernels refuse are now left to Inductor), profiled
    step sp_async_tp_bisect 200 python3 tools/sp_async_tp_bisect.py --world 2 --batch 4
    tests compile_backend_tests 100 -x -q tests/gpu/test_compile_backend.py -k "2]"
    step model_autocast 170 python3 bench/model.py --world 2 --cases train-tp --train 2048 --train-batch 1 \
      --autocast --no-aa --profile --json "$OUT/model_autocast.json"
    final_summary() {
      echo "=== sp_async_tp_bisect"; grep -v -E "^(W[0-9]|  warnings)" "$OUT/sp_async_tp_bisect.log" | tail -12
      model_lines model_autocast
      sed -n '/GPU time per step by kernel category/,/first kernel start/p' "$OUT/model_autocast.log"
    }
    ;;
  s10-isolated)  # 2 GPUs (~5 min): issue 26's train-tp ratio with each variant alone in its own process (A B B A)
    step isolated_tp 280 python3 bench/model_isolated.py --world 2 --cases train-tp --train 2048 --train-batch 1 \
      --run-timeout 90 --json "$OUT/isolated_tp.json"
    final_summary() { grep -h -E "^(\||note)" "$OUT"/isolated_tp.log | grep -v "^|---"; }
    ;;
  s11-next)  # 2 GPUs (~9 min; prebuilt modules): the bisect again with the refusal really lifted (session 10's
             # patch did not reach the passes), then train-tp's A B B A isolated runs (each run's time printed as it ends)
    step sp_async_tp_bisect 170 python3 tools/sp_async_tp_bisect.py --world 2 --batch 4 \
      --variants both keep-only scatter-only neither
    step isolated_tp 370 python3 bench/model_isolated.py --world 2 --cases train-tp --train 2048 --train-batch 1 \
      --run-timeout 95 --json "$OUT/isolated_tp.json"
    final_summary() {
      echo "=== sp_async_tp_bisect"; grep -v -E "^(W[0-9]|  warnings)|Warning|enable\(" "$OUT/sp_async_tp_bisect.log" | tail -10
      echo "=== isolated_tp"; grep -h -E "^(\[|\||note)" "$OUT"/isolated_tp.log | grep -v "^|---"
    }
    ;;
  s11-sp)  # 2 GPUs (~7.5 min): the batch > 1 GEMM + reduce-scatter fusion now runs next to async TP: the GPU test
           # (gradients vs eager at batch 2), then train-sp at batch 4 in isolated A B B A runs
    tests compile_backend_tests 100 -x -q tests/gpu/test_compile_backend.py -k "2]"
    step isolated_sp4 330 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 --train-batch 4 \
      --run-timeout 95 --json "$OUT/isolated_sp4.json"
    final_summary() { echo "=== isolated_sp4"; grep -h -E "^(\[|\||note)" "$OUT"/isolated_sp4.log | grep -v "^|---"; }
    ;;
  s12-next)  # 2 GPUs (~7 min; prebuilt modules): train-sp at batch 4 with the GEMM + reduce-scatter fusion next
             # to async TP, isolated A B B A (batch 4 compiles take more than 95 s)
    step isolated_sp4 540 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 --train-batch 4 \
      --run-timeout 160 --json "$OUT/isolated_sp4.json"
    final_summary() { echo "=== isolated_sp4"; grep -h -E "^(\[|\||note)" "$OUT"/isolated_sp4.log | grep -v "^|---"; }
    ;;
  s15-overlap)  # 2 GPUs (~8 min; prebuilt modules): backward reduce-scatters left to NCCL under the weight gradients
                # and FP8 weight casts under the forward all-gathers (opfuse/torch_compile/overlap.py): opfuse FP8
                # trained under CUDA graphs, its kernel table (train-sp 2048), then isolated A B B A against
                # torch.compile bf16 with async TP after a warm-up run
    END=${S15_BUDGET_S:-540}
    step fp8_graphs_profile "$(fits 100 440)" python3 bench/model.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --no-aa --fp8 tensor-pow2 --only "opfuse fp8" --train-mode reduce-overhead --profile
    step isolated_fp8_graphs "$(fits 440 0)" python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8@graphs" --warmup-run --run-timeout 110 \
      --json "$OUT/isolated_fp8_graphs.json"
    final_summary() { model_lines fp8_graphs_profile; grep -E "^\| (category|gemm|nccl|GPU|first|opfuse fp8 \|)" \
                        "$OUT/fp8_graphs_profile.log";
                      grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_graphs.log | grep -v "^|---"; }
    ;;
  s17-dtensor-order)  # 2 GPUs (~3 min; prebuilt modules): the waits of a DTensor model's collectives left to NCCL stay
                      # after the GEMMs scheduled under them (Inductor's peak-memory reordering off for DTensor graphs)
    END=${S17_BUDGET_S:-300}
    sp=(python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 --no-aa --profile)
    step fp8_graphs "$(fits 120 100)" "${sp[@]}" --fp8 tensor-pow2 --only "opfuse fp8" --train-mode reduce-overhead
    step bf16_opfuse "$(fits 110 0)" "${sp[@]}" --only opfuse
    final_summary() { for name in fp8_graphs bf16_opfuse; do model_lines $name;
                        grep -E "^\| (gemm|nccl|GPU|first)" "$OUT/$name.log"; grep -A24 "NCCL kernels of" "$OUT/$name.log" \
                        | cut -c1-200; done; }
    ;;
  s17-moe-fp8)  # 1 GPU (~5 min; prebuilt modules): the FP8 grouped GEMM's weight made once per step in one cast
                # (both layouts), the tail/empty-expert fix-ups, views of stacked expert weights hitting the cache:
                # GPU tests, then bench/moe.py --fp8 --profile
    END=${S17_BUDGET_S:-560}
    tests fp8_grouped_tests 150 -q tests/gpu/test_fp8.py -k "stack or grouped"
    tests compile_fp8_moe_tests 150 -q tests/gpu/test_compile_fp8_moe.py
    step moe_bench "$(fits 300 0)" python3 bench/moe.py --fp8 --profile --json "$OUT/moe.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/fp8_grouped_tests.log" "$OUT/compile_fp8_moe_tests.log" | tail -4;
                      grep -E "^(\||relative|note|T=[0-9]+: GPU)" "$OUT/moe_bench.log" | grep -v "^|---" | cut -c1-260; }
    ;;
  s17-fp8-gather)  # 2 GPUs (~9.5 min; prebuilt modules): session 16's CPU-checked change, the per-layer forward
                   # all-gathers of FP8 train-sp moving FP8 bytes (quantize fused into the norm): the SM-carveout and
                   # FP8 GPU tests, then opfuse FP8 under CUDA graphs against torch.compile bf16, A B B A after a warm-up
    END=${S17_BUDGET_S:-560}
    tests gpu_tests "$(fits 90 450)" -x -q tests/gpu/test_sm_carveout.py tests/gpu/test_fp8_dist.py
    step isolated_fp8_gather "$(fits 450 0)" python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8@graphs" --warmup-run --run-timeout 110 \
      --json "$OUT/isolated_fp8_gather.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/gpu_tests.log" | tail -2;
                      grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_gather.log | grep -v "^|---"; }
    ;;
  s16-gpu-tests)  # 1 GPU (~1 min; prebuilt modules): session 16's GPU tests of the SM-carveout GEMMs, written after
                   # its device time was spent
    tests sm_carveout_tests 120 -q tests/gpu/test_sm_carveout.py
    final_summary() { grep -h -E "passed|failed|error" "$OUT/sm_carveout_tests.log" | tail -3; }
    ;;
  s16-carveout)  # 2 GPUs (~8 min; prebuilt modules): why the collectives left to NCCL do not run under the FP8 GEMMs
                 # of a CUDA graph: opfuse FP8 train-sp 2048 under graphs, kernel table each, as it is, with a
                 # high-priority NCCL stream, with the GEMMs under a collective leaving 16 SMs, with both
    END=${S16_BUDGET_S:-540}
    sp=(python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 --no-aa --fp8 tensor-pow2
        --only "opfuse fp8" --train-mode reduce-overhead --profile)
    step fp8_as_is "$(fits 110 330)" "${sp[@]}"
    TORCH_NCCL_HIGH_PRIORITY=1 step fp8_priority "$(fits 110 220)" "${sp[@]}"
    OPFUSE_OVERLAP_SM_CARVEOUT=16 step fp8_carve16 "$(fits 110 110)" "${sp[@]}"
    TORCH_NCCL_HIGH_PRIORITY=1 OPFUSE_OVERLAP_SM_CARVEOUT=16 step fp8_carve16_priority "$(fits 110 0)" "${sp[@]}"
    final_summary() { for name in fp8_as_is fp8_priority fp8_carve16 fp8_carve16_priority; do model_lines $name;
                        grep -E "^\| (category|gemm|nccl|GPU|first|opfuse fp8 \|)|under the collective" "$OUT/$name.log" \
                        | cut -c1-300; done; }
    ;;
  s16-carveout2)  # 2 GPUs (~6 min; prebuilt modules): s16-carveout's SM carveouts once the carveout GEMMs got their
                  # traced operand layouts: opfuse FP8 train-sp 2048 under graphs leaving 16, 8 and 32 SMs
    END=${S16_BUDGET_S:-420}
    sp=(python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 --no-aa --fp8 tensor-pow2
        --only "opfuse fp8" --train-mode reduce-overhead --profile)
    OPFUSE_OVERLAP_SM_CARVEOUT=16 step fp8_carve16 "$(fits 110 220)" "${sp[@]}"
    OPFUSE_OVERLAP_SM_CARVEOUT=8 step fp8_carve8 "$(fits 110 110)" "${sp[@]}"
    OPFUSE_OVERLAP_SM_CARVEOUT=32 step fp8_carve32 "$(fits 110 0)" "${sp[@]}"
    final_summary() { for name in fp8_carve16 fp8_carve8 fp8_carve32; do model_lines $name;
                        grep -E "^\| (category|gemm|nccl|GPU|first|opfuse fp8 \|)|under the collective" "$OUT/$name.log" \
                        | cut -c1-300; done; }
    ;;
  s19-moe)  # 1 GPU (~6 min; prebuilt modules): session 18's CPU-checked pieces: the one-read power-of-two quantizer
            # over stacked expert weights (and the dense one's fixup loop rewritten as a while loop), the shared
            # padded layout of the FP8 wgrad; then FP8 MoE: bf16 wgrad, FP8 wgrad, pow2 expert weights, one run
    END=${S19_BUDGET_S:-560}
    tests fp8_tests 150 -q tests/gpu/test_fp8.py -k "stack or grouped or group_column or one_read"
    step moe_bench "$(fits 330 0)" python3 bench/moe.py --fp8 --fp8-wgrad-ab --fp8-pow2 --profile \
      --json "$OUT/moe.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/fp8_tests.log" | tail -2;
                      grep -h -E "^(FAILED|ERROR)" "$OUT/fp8_tests.log" | head -8;
                      grep -E "^(\||relative|note|T=[0-9]+: GPU)" "$OUT/moe_bench.log" | grep -v "^|---" | cut -c1-260; }
    ;;
  s19-moe-gather)  # 1 GPU (~5.5 min; prebuilt modules): session 19's CPU-checked changes: tokens moved to and from
                   # expert order by gathers both ways (no atomic index_add), the one-read per-row quantizer;
                   # quantizer + compiled FP8 MoE GPU tests, then FP8 MoE (FP8 wgrad, pow2 experts) profiled
    END=${S19_BUDGET_S:-540}
    tests fp8_tests 120 -q tests/gpu/test_fp8.py -k "quantizers_match or stack or grouped"
    tests compile_moe_tests 150 -q tests/gpu/test_compile_fp8_moe.py
    step moe_bench "$(fits 260 0)" python3 bench/moe.py --fp8 --fp8-pow2 --profile --json "$OUT/moe.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/fp8_tests.log" "$OUT/compile_moe_tests.log" | tail -2;
                      grep -h -E "^(FAILED|ERROR)" "$OUT/fp8_tests.log" "$OUT/compile_moe_tests.log" | head -8;
                      grep -E "^(\||relative|note|T=[0-9]+: GPU)" "$OUT/moe_bench.log" | grep -v "^|---" | cut -c1-260; }
    ;;
  s19-fp8-sp)  # 2 GPUs (~7 min; prebuilt modules): the FP8 collective GEMM and FSDP grouped FP8 wgrad tests at world 2
               # (s19-fp8-dist's), then FP8 pow2 train-sp under CUDA graphs vs torch.compile bf16, A B B A after a
               # warm-up (s17-fp8-gather's measurement, after session 18's dense one-read launcher change)
    END=${S19_BUDGET_S:-570}
    tests gpu_tests 150 -q tests/gpu/test_sm_carveout.py tests/gpu/test_fp8_dist.py
    step isolated_fp8_sp "$(fits 450 0)" python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8@graphs" --warmup-run --run-timeout 110 \
      --json "$OUT/isolated_fp8_sp.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/gpu_tests.log" | tail -2; grep -h -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -8;
                      grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_sp.log | grep -v "^|---"; }
    ;;
  s19-fp8-rs)  # 2 GPUs (~8 min; prebuilt modules): FP8 pow2 train-sp 2048 under CUDA graphs, the FP8 GEMM + reduce-
               # scatter over peer memory (p2p_overlap, forced) against the table's nccl, each alone, A B B A after a warm-up
    step isolated_fp8_rs 540 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 --train-batch 1 \
      --fp8 tensor-pow2 --pair "opfuse fp8@graphs" "opfuse fp8@graphs%linear_reduce_scatter_fp8=p2p_overlap" \
      --warmup-run --run-timeout 110 --json "$OUT/isolated_fp8_rs.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_rs.log | grep -v "^|---"; }
    ;;
  s21-single)  # 1 GPU (~4 min; prebuilt modules): this session's compile-path changes on a GPU with Inductor:
               # single-GPU fused ops incl. linears under torch.autocast, FP8 / MoE / merged projections
    END=${S21_BUDGET_S:-280}
    tests fused_single "$(fits 120 150)" -x -q tests/gpu/test_fused_single_gpu.py
    tests compile_fp8_moe "$(fits 240 0)" -x -q tests/gpu/test_compile_fp8_moe.py
    final_summary() { grep -h -E "passed|failed|Error" "$OUT/fused_single.log" "$OUT/compile_fp8_moe.log" | tail -6; }
    ;;
  s22-gather-ab)  # 2 GPUs (~6 min; prebuilt modules; after s21-gather passed): FP8 train-sp 2048 under graphs with the
                  # backward gradient gathers over peer memory against NCCL's, each alone, A B B A
    END=${S22_BUDGET_S:-575}
    step isolated_gather "$(fits 560 0)" python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair "opfuse fp8@graphs" "opfuse fp8@graphs%P2P_GRADIENT_GATHERS=1" \
      --run-timeout 110 --json "$OUT/isolated_gather.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_gather.log | grep -v "^|---"; }
    ;;
  s22-gather-bf16)  # 2 GPUs (~7 min; prebuilt modules): the same for bf16 train-sp 2048 (opfuse vs opfuse with
                    # the gradient gathers over peer memory), A B B A
    END=${S22_BUDGET_S:-585}
    step isolated_gather_bf16 "$(fits 570 0)" python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --pair opfuse "opfuse%P2P_GRADIENT_GATHERS=1" --run-timeout 120 \
      --json "$OUT/isolated_gather_bf16.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_gather_bf16.log | grep -v "^|---"; }
    ;;
  s21-gather)  # 2 GPUs (~4 min; prebuilt modules): the backward's gradient all-gathers over peer memory (copy
               # engines, new all_gather_tokens + gradient_all_gather rule): GPU tests, the gather alone against
               # NCCL per size, then one FP8 train-sp 2048 step profiled under graphs
    END=${S21_BUDGET_S:-290}
    tests gather_tests 110 -q tests/gpu/test_gather_tokens.py
    step gather_bench 60 python3 bench/gather_tokens.py --world 2 --kib 64 256 1024 4096 8192
    OPFUSE_P2P_GRADIENT_GATHERS=1 step fp8_gather "$(fits 130 0)" python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 \
      --no-aa --fp8 tensor-pow2 --only "opfuse fp8" --train-mode reduce-overhead --profile
    final_summary() { grep -h -E "passed|failed|Error" "$OUT/gather_tests.log" | tail -4;
                      grep -h -E "^\|" "$OUT/gather_bench.log"; model_lines fp8_gather;
                      grep -E "^\| (category|gemm|nccl|GPU|symm|opfuse fp8 \|)|AllGather|under the collective" \
                        "$OUT/fp8_gather.log" | cut -c1-300; }
    ;;
  s21-carveout)  # 2 GPUs (~9.5 min; prebuilt modules): session 20's profile showed each backward all-gather of FP8
                 # train-sp waiting for the persistent weight-gradient GEMM moved under it (6-9 us beside, 5 x ~100
                 # us exposed): the SM carveout, now applied to those GEMMs too. GPU carveout tests, a profile with
                 # 16 SMs left to NCCL (it warms the machine), then FP8 under graphs without and with it, A B B A
    END=${S21_BUDGET_S:-570}
    tests carveout_tests 90 -q tests/gpu/test_sm_carveout.py
    OPFUSE_OVERLAP_SM_CARVEOUT=16 step fp8_carve16 "$(fits 130 420)" python3 bench/model.py --world 2 --cases train-sp \
      --train 2048 --train-batch 1 --no-aa --fp8 tensor-pow2 --only "opfuse fp8" --train-mode reduce-overhead --profile
    step isolated_carve "$(fits 440 0)" python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair "opfuse fp8@graphs" "opfuse fp8@graphs%OVERLAP_SM_CARVEOUT=16" \
      --run-timeout 110 --json "$OUT/isolated_carve.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/carveout_tests.log" | tail -2; model_lines fp8_carve16;
                      grep -E "^\| (category|gemm|nccl|GPU|first|opfuse fp8 \|)|AllGather|under the collective" \
                        "$OUT/fp8_carve16.log" | cut -c1-300;
                      grep -h -E "^(\[|\||note)" "$OUT"/isolated_carve.log | grep -v "^|---"; }
    ;;
  s21-priority)  # 2 GPUs (~4 min; prebuilt modules): the other remedy for the backward gathers waiting for their
                 # GEMM: NCCL on a high-priority stream (its blocks dispatched first when both are ready), and
                 # an 8-SM carveout; FP8 train-sp under graphs, profiled, one run each
    END=${S21_BUDGET_S:-300}
    sp=(python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 --no-aa --fp8 tensor-pow2
        --only "opfuse fp8" --train-mode reduce-overhead --profile)
    TORCH_NCCL_HIGH_PRIORITY=1 step fp8_priority "$(fits 130 130)" "${sp[@]}"
    OPFUSE_OVERLAP_SM_CARVEOUT=8 step fp8_carve8 "$(fits 130 0)" "${sp[@]}"
    final_summary() { for name in fp8_priority fp8_carve8; do model_lines $name;
                        grep -E "^\| (category|gemm|nccl|GPU|first|opfuse fp8 \|)|AllGather|under the collective" \
                        "$OUT/$name.log" | cut -c1-300; done; }
    ;;
  s20-fp8-sp)  # 2 GPUs (~9 min; prebuilt modules): FP8 pow2 train-sp 2048 under CUDA graphs (p2p_overlap FP8 reduce-
               # scatter now the default) vs torch.compile bf16 with async TP, each alone, A B B A after a warm-up
    step isolated_fp8_sp 560 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 --train-batch 1 \
      --fp8 tensor-pow2 --pair compile "opfuse fp8@graphs" --warmup-run --run-timeout 110 --json "$OUT/isolated_fp8_sp.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_sp.log | grep -v "^|---"; }
    ;;
  s20-fp8-sp8192)  # 2 GPUs (~7 min; prebuilt modules): the same at 8192 tokens, A B B A without a warm-up run (a
                   # warm-up does not fit in one call at this size; run it on a machine that is already warm)
    step isolated_fp8_sp8192 570 python3 bench/model_isolated.py --world 2 --cases train-sp --train 8192 --train-batch 1 \
      --fp8 tensor-pow2 --pair compile "opfuse fp8@graphs" --run-timeout 135 --json "$OUT/isolated_fp8_sp8192.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_sp8192.log | grep -v "^|---"; }
    ;;
  s20-chunked-ar)  # 2 GPUs (~9 min; prebuilt modules): session 19's CPU-checked split of the row-parallel GEMM + forward
                   # all-reduce (auto: chunks of >= 2048 tokens; off by default): train-tp 8192, opfuse as is
                   # (never split) vs auto (OPFUSE_ALLREDUCE_CHUNKS=0), each alone, A B B A after a warm-up
    step isolated_chunked_ar 560 python3 bench/model_isolated.py --world 2 --cases train-tp --train 8192 --train-batch 1 \
      --pair opfuse "opfuse%ALLREDUCE_CHUNKS=0" --warmup-run --run-timeout 130 --json "$OUT/isolated_chunked_ar.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_chunked_ar.log | grep -v "^|---"; }
    ;;
  s19-wgrad-sweep)  # 1 GPU (~5 min; prebuilt modules): where the FP8 grouped weight gradient starts to pay (faster at
                    # 16384 tokens, slower at 4096 in session 18): FP8 vs bfloat16 wgrad over a token sweep, profiled
    step moe_sweep 420 python3 bench/moe.py --fp8 --fp8-wgrad-ab --tokens 2048 4096 8192 16384 \
      --only "compile dynamic" "opfuse fp8 hp-wgrad" "opfuse fp8" --profile --json "$OUT/moe_sweep.json"
    final_summary() { grep -E "^(\||relative|note|T=[0-9]+: GPU)" "$OUT/moe_sweep.log" | grep -v "^|---" | cut -c1-200; }
    ;;
  s19-fp8-dist)  # 2 GPUs (~1.5 min; prebuilt modules): session 18's FP8 grouped weight gradient under FSDP at world 2
                 # (tests/gpu/test_fp8_dist.py's grouped_fsdp: scaled_grouped_mm against the reference, gradients
                 # reduce-scattered), with the FP8 collective GEMM cases
    tests fp8_dist_tests 200 -q tests/gpu/test_fp8_dist.py
    final_summary() { grep -h -E "passed|failed" "$OUT/fp8_dist_tests.log" | tail -2; }
    ;;
  s18-moe-wgrad)  # 1 GPU (~4.5 min; prebuilt modules): the FP8 grouped weight gradient (E4M3 per expert and feature,
                  # operands transposed into a padded token layout by two Triton kernels): GPU tests, then the MoE bench
    END=${S18_BUDGET_S:-380}
    tests fp8_grouped_tests 120 -q tests/gpu/test_fp8.py -k "stack or grouped or group_column"
    step moe_bench "$(fits 200 0)" python3 bench/moe.py --fp8 --profile --json "$OUT/moe.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/fp8_grouped_tests.log" | tail -2;
                      grep -h -E "^(FAILED|ERROR)" "$OUT/fp8_grouped_tests.log" | head -8;
                      grep -E "^(\||relative|note|T=[0-9]+: GPU)" "$OUT/moe_bench.log" | grep -v "^|---" | cut -c1-260; }
    ;;
  s18-bf16-tp)  # 2 GPUs (~6 min; prebuilt modules): bf16 train-tp 2048 (torch.distributed all-reduces) after session 17's
                # deferred weight gradients (never slower than torch.compile?): each alone, A B B A after a warm-up
    step isolated_bf16_tp 500 python3 bench/model_isolated.py --world 2 --cases train-tp --train 2048 \
      --train-batch 1 --warmup-run --run-timeout 100 --json "$OUT/isolated_bf16_tp.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_bf16_tp.log | grep -v "^|---"; }
    ;;
  s16-bf16-sp)  # 2 GPUs (~8 min; prebuilt modules): bf16 train-sp 2048 after session 15's backward reduce-scatter
                # scheduling (never slower than torch.compile?): opfuse vs compile, each alone, A B B A after a warm-up
    step isolated_bf16_sp 500 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --warmup-run --run-timeout 100 --json "$OUT/isolated_bf16_sp.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_bf16_sp.log | grep -v "^|---"; }
    ;;
  s16-nccl-priority)  # 2 GPUs (~9 min; prebuilt modules): does a high-priority NCCL stream let the collectives
                      # opfuse leaves to NCCL run under the FP8 GEMMs in a CUDA graph (session 15: they did not)?
                      # opfuse FP8 under graphs with TORCH_NCCL_HIGH_PRIORITY=1, kernel table; then A B B A
                      # against torch.compile bf16, both with it
    END=${S16_BUDGET_S:-560}
    TORCH_NCCL_HIGH_PRIORITY=1 step fp8_graphs_priority "$(fits 110 440)" python3 bench/model.py --world 2 \
      --cases train-sp --train 2048 --train-batch 1 --no-aa --fp8 tensor-pow2 --only "opfuse fp8" \
      --train-mode reduce-overhead --profile
    TORCH_NCCL_HIGH_PRIORITY=1 step isolated_priority "$(fits 440 0)" python3 bench/model_isolated.py --world 2 \
      --cases train-sp --train 2048 --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8@graphs" \
      --warmup-run --run-timeout 110 --json "$OUT/isolated_priority.json"
    final_summary() { model_lines fp8_graphs_priority; grep -E "^\| (category|gemm|nccl|GPU|first|opfuse fp8 \|)" \
                        "$OUT/fp8_graphs_priority.log";
                      grep -h -E "^(\[|\||note)" "$OUT"/isolated_priority.log | grep -v "^|---"; }
    ;;
  s15-fp8-graphs)  # 2 GPUs (~9 min; prebuilt modules): opfuse FP8 (pow2) trained under CUDA graphs against
                   # torch.compile bf16 (async TP), train-sp 2048, each alone, A B B A after a warm-up run
    step isolated_fp8_graphs 560 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8@graphs" --warmup-run --run-timeout 110 \
      --json "$OUT/isolated_fp8_graphs.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_graphs.log | grep -v "^|---"; }
    ;;
  s15-fp8-rs)  # 2 GPUs (~8 min; prebuilt modules): the FP8 reduce-scatter over peer memory (p2p_overlap, after nccl
               # in the table until this runs): the world-2 FP8 block tests (forced), then opfuse FP8 trained under
               # CUDA graphs in train-sp 2048 with it forced and without, each alone
    END=${S15_BUDGET_S:-520}
    tests fp8_dist_tests "$(fits 200 240)" -x -q tests/gpu/test_fp8_dist.py
    sp=(python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 --no-aa --fp8 tensor-pow2
        --only "opfuse fp8" --train-mode reduce-overhead)
    OPFUSE_FORCE_IMPL=linear_reduce_scatter_fp8=p2p_overlap step fp8_graphs_p2p_rs "$(fits 115 120)" "${sp[@]}"
    step fp8_graphs_nccl_rs "$(fits 115 0)" "${sp[@]}"
    final_summary() { grep -h -E "passed|failed" "$OUT/fp8_dist_tests.log" | tail -2;
                      model_lines fp8_graphs_p2p_rs fp8_graphs_nccl_rs; }
    ;;
  s14-graphs)  # 2 GPUs (~9 min; prebuilt modules): the FP8 compile GPU tests (session 13's direct overloads; FP8
               # training under CUDA graphs), then FP8 (pow2 weights) train-sp at 2048 tokens in one process with
               # compile and opfuse bf16 beside it, without and with CUDA graphs (--train-mode reduce-overhead):
               # the FP8 step's host issue time was at its GPU time (session 13)
    END=${S14_BUDGET_S:-540}
    tests compile_fp8_tests "$(fits 150 400)" -q -s tests/gpu/test_compile_fp8_moe.py
    step fp8_sp_default "$(fits 190 200)" python3 bench/model.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --no-aa --json "$OUT/fp8_sp_default.json"
    step fp8_sp_graphs "$(fits 210 0)" python3 bench/model.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --no-aa --train-mode reduce-overhead --json "$OUT/fp8_sp_graphs.json"
    final_summary() { grep -h -E "passed|failed" "$OUT/compile_fp8_tests.log" | tail -3;
                      model_lines fp8_sp_default fp8_sp_graphs; }
    ;;
  s14-graphs2)  # 2 GPUs (~6 min; prebuilt modules): which training variant fails under CUDA graphs and why
                # (allocation history of the untracked pool tensors), then opfuse FP8's kernel table and host
                # profile in train-sp 2048 without graphs
    END=${S14_BUDGET_S:-420}
    BENCH_CUDAGRAPH_HISTORY=1 step fp8_graphs_only "$(fits 130 240)" python3 bench/model.py --world 2 --cases train-sp \
      --train 2048 --train-batch 1 --fp8 tensor-pow2 --no-aa --only "opfuse fp8" --train-mode reduce-overhead
    BENCH_CUDAGRAPH_HISTORY=1 step compile_graphs_only "$(fits 110 130)" python3 bench/model.py --world 2 \
      --cases train-sp --train 2048 --train-batch 1 --no-aa --only compile --train-mode reduce-overhead
    OPFUSE_HOST_PROFILE_TOP=40 step fp8_profile "$(fits 130 0)" python3 bench/model.py --world 2 --cases train-sp \
      --train 2048 --train-batch 1 --fp8 tensor-pow2 --no-aa --only "opfuse fp8" --profile
    final_summary() { model_lines fp8_graphs_only compile_graphs_only fp8_profile; }
    ;;
  s14-graphs3)  # 2 GPUs (~9.5 min; prebuilt modules): the graph-pool tests, then train-sp 2048, each variant alone:
                # opfuse FP8 (pow2) and compile bf16 with CUDA graphs (async TP off: torch's workspace fails the
                # pool check), compile bf16 (async TP) and opfuse FP8 without; each run takes 65-95 s
    END=${S14_BUDGET_S:-570}
    tests graph_pool_tests "$(fits 70 440)" -q tests/gpu/test_graph_pool.py tests/gpu/test_compile_fp8_moe.py \
      -k "pool or cuda_graphs"
    sp=(python3 bench/model.py --world 2 --cases train-sp --train 2048 --train-batch 1 --no-aa)
    step fp8_graphs "$(fits 115 330)" "${sp[@]}" --fp8 tensor-pow2 --only "opfuse fp8" --train-mode reduce-overhead
    step compile_graphs "$(fits 110 220)" "${sp[@]}" --only compile --train-mode reduce-overhead
    step compile_default "$(fits 110 110)" "${sp[@]}" --only compile
    step fp8_default "$(fits 110 0)" "${sp[@]}" --fp8 tensor-pow2 --only "opfuse fp8"
    final_summary() { grep -h -E "passed|failed" "$OUT/graph_pool_tests.log" | tail -2;
                      model_lines fp8_graphs compile_graphs compile_default fp8_default; }
    ;;
  s14-fp8-sp)  # 2 GPUs (~9.5 min; prebuilt modules): FP8 (pow2 weights) train-sp at 2048 tokens against
               # torch.compile bf16, each variant alone after a discarded warm-up run, A B B A: session 13's
               # direct overloads of the FP8 graph ops were predicted to save 0.6-1.2 ms of host time a step
    step isolated_fp8_sp 550 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8" --warmup-run --run-timeout 120 \
      --json "$OUT/isolated_fp8_sp.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_sp.log | grep -v "^|---"; }
    ;;
  s13-fp8-sp)  # 2 GPUs (~8 min; prebuilt modules): the FP8 GPU training test against the emulation and the
               # float64 model, then opfuse FP8 (pow2 weights) against torch.compile bf16 in train-sp at 2048
               # tokens, each variant alone, after a discarded warm-up run
    tests compile_fp8_train_tests 90 -q -s tests/gpu/test_compile_fp8_moe.py -k "training_on_the_gpu"
    step isolated_fp8_sp 430 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8" --warmup-run --run-timeout 115 \
      --json "$OUT/isolated_fp8_sp.json"
    final_summary() { grep -h -E "relative errors|passed|failed" "$OUT/compile_fp8_train_tests.log" | tail -8;
                      grep -h -E "^(\[|\||note)" "$OUT"/isolated_fp8_sp.log | grep -v "^|---"; }
    ;;
  s13-next)  # 2 GPUs (~9.5 min; prebuilt modules): what session 12 left unchecked: the pow2 cases of the compile
             # GPU tests (a cudagraph-pool fix not rerun, a norm-gradient bound), then train-sp at batch 4 again,
             # isolated with a discarded warm-up run (session 12's cold-start runs drifted 16%)
    tests compile_fp8_pow2_tests 100 -q -s tests/gpu/test_compile_fp8_moe.py -k "training_on_the_gpu or cuda_graphs"
    step isolated_sp4 470 python3 bench/model_isolated.py --world 2 --cases train-sp --train 2048 --train-batch 4 \
      --warmup-run --run-timeout 115 --json "$OUT/isolated_sp4.json"
    final_summary() { grep -h -E "relative errors|passed|failed" "$OUT/compile_fp8_pow2_tests.log" | tail -8;
                      grep -h -E "^(\[|\||note)" "$OUT"/isolated_sp4.log | grep -v "^|---"; }
    ;;
  s12-fp8)  # 2 GPUs (~8 min; prebuilt modules, .thirdparty/wheels carried): power-of-two weight scales (issue 27):
            # the one-read quantizer's GPU tests, its bench against Inductor's quantization and the copy floor,
            # then opfuse FP8 (pow2 weights) against torchao float8, each variant alone (train-tp 2048)
    install_bench_wheels
    tests fp8_pow2_tests 120 -x -q tests/gpu/test_fp8.py -k "one_read or pow2"
    CUDA_VISIBLE_DEVICES=0 step fp8_weight_quant 90 python3 bench/fp8_weight_quant.py --json "$OUT/fp8_weight_quant.json"
    PYTHONPATH=.:/tmp/site-bench step isolated_fp8_torchao 380 python3 bench/model_isolated.py --world 2 \
      --cases train-tp --train 2048 --train-batch 1 --fp8 tensor-pow2 --pair "torchao fp8" "opfuse fp8" \
      --run-timeout 110 --json "$OUT/isolated_fp8_torchao.json"
    final_summary() { sed -n '/^one weight/,$p' "$OUT/fp8_weight_quant.log"; grep -h -E "^(\[|\||note)" \
                      "$OUT"/isolated_*.log | grep -v "^|---"; }
    ;;
  s12-fp8-compile)  # 2 GPUs (~6 min): opfuse FP8 (pow2 weights) against torch.compile bf16, each variant alone
    step isolated_fp8_compile 380 python3 bench/model_isolated.py --world 2 --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --pair compile "opfuse fp8" --run-timeout 110 \
      --json "$OUT/isolated_fp8_compile.json"
    final_summary() { grep -h -E "^(\[|\||note)" "$OUT"/isolated_*.log | grep -v "^|---"; }
    ;;
  model-timeline)  # 2 GPUs (~7 min with the build): where training steps lose time (issue 26): train-tp and
                   # train-sp with kernel tables and one step's host + device timeline per variant, then the
                   # two-GPU residual-norm and Lamport tests
    step model_bench 330 python3 bench/model.py --world 2 --cases train-tp train-sp --train 2048 \
      --train-batch 1 --profile --variants opfuse:fuse-all --json "$OUT/model.json"
    tests residual_norm_dist 60 -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    tests lamport_kernels 50 -x -q --maxfail=3 tests/gpu/test_residual_norm_lamport.py
    final_summary() { echo "=== model_bench"; sed -n '/^summary/,$p' "$OUT/model_bench.log" | head -5;
                      grep -E "^(\[|\||world .*(timeline|gaps)|  +[0-9])" "$OUT/model_bench.log" | grep -v "^|---" | tail -90; }
    ;;
  compile-backend)
    tests compile_backend_tests 600 -x -q tests/gpu/test_compile_backend.py
    step model_bench 900 python3 bench/model.py --world 2 --no-train-8192 --json "$OUT/model.json"
    ;;
  world8)
    tests residual_norm_dist 150 -x -q tests/gpu/test_residual_norm_dist.py -k "8]"
    tests overlap_tests 220 -x -q tests/gpu/test_overlap.py -k "8]"
    tests graphed_tests 180 -x -q tests/gpu/test_graphed.py -k "8]"
    ;;
  world8-bench)
    step allreduce_bench 220 python3 bench/allreduce_norm.py --world 8 --json "$OUT/allreduce_norm.json"
    step overlap_bench 200 python3 bench/overlap.py --world 8 --m 512 2048 8192 --chunks
    step push_bench 100 python3 bench/push_bandwidth.py --world 8
    ;;
  allreduce|allreduce-bench|allreduce-crossover)
    if [ "$stage" != allreduce-crossover ]; then
      step flashinfer_build 240 python3 bench/flashinfer_ar/build.py
      allreduce_vs_flashinfer 200 90 420 2 4
    fi
    if [ "$stage" != allreduce-bench ]; then
      crossover_sweep 300 60 2 3 4
    fi
    final_summary() {
      echo "=== flashinfer binding"; tail -3 "$OUT/flashinfer_build.log" "$OUT/flashinfer_check.log" 2>/dev/null
      show allreduce_bench crossover_sweep crossover_table
    }
    ;;
  ar-bandwidth)
    # Issue 30 in one device call, budgeted (END, fits above). Most valuable first: the protocol
    # tests catch a broken kernel (bounded waits: a failure, not a hang), then the benchmark.
    END=${AR_BUDGET_S:-520}
    tests lamport_kernels "$(fits 150 330)" -q --maxfail=3 tests/gpu/test_residual_norm_lamport.py
    tests lamport_dist "$(fits 150 270)" -x -q tests/gpu/test_residual_norm_lamport_dist.py -k "2]"
    fi_flag=--no-flashinfer
    if [ -d .thirdparty/flashinfer ]; then
      step flashinfer_build "$(fits 90 250)" python3 bench/flashinfer_ar/build.py
      step flashinfer_check "$(fits 60 240)" python3 bench/flashinfer_ar/check.py --world 2 --timeout 45
      grep -q "flashinfer check passed" "$OUT/flashinfer_check.log" 2>/dev/null && fi_flag=
    else
      fi_flag=  # the bench's FlashInfer column then says why it is empty (no headers)
    fi
    step allreduce_quick "$(fits 280 30)" python3 bench/allreduce_norm.py --quick --json "$OUT/allreduce_quick.json" $fi_flag
    tests lamport_timeout "$(fits 60 0)" -x -q tests/gpu/test_peer_timeout.py -k lamport
    final_summary() {
      echo "=== flashinfer"; tail -2 "$OUT/flashinfer_build.log" "$OUT/flashinfer_check.log" 2>/dev/null
      grep -E "^(measured ceilings|not measured)" "$OUT/allreduce_quick.log" 2>/dev/null | sort -u | cut -c1-400
      if grep -q "^summary" "$OUT/allreduce_quick.log" 2>/dev/null; then
        show allreduce_quick
      else  # cut before its tables: the per-size progress lines hold the times
        echo "=== allreduce_quick (no summary: cut or failed)"; grep "tokens done" "$OUT/allreduce_quick.log" | tail -16
      fi
    }
    ;;
  s22-ar-small)
    # Issue 30's small messages in one call on 2 GPUs (~9.5 min; modules prebuilt and carried, plus the
    # previous main's opfuse/ and bench/ with their own modules in .baseline/, so old and new kernels are
    # timed on one machine): the per-block call state's protocol tests (simulated ranks; world 2 over
    # NCCL), the quick bench at 1-256 tokens (new, with FlashInfer; then the previous kernels), the
    # one-shot's phase timeline, and the Lamport kernel's tests last.
    END=${AR_BUDGET_S:-560}
    tests kernels "$(fits 150 420)" -q --maxfail=3 tests/gpu/test_residual_norm_kernels.py \
      -k "oneshot or grid or peer_kernels or skips"
    tests residual_norm_dist "$(fits 90 360)" -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    flashinfer_checked 300
    step allreduce_new "$(fits 150 170)" python3 bench/allreduce_norm.py --quick --tokens 1 4 16 64 256 \
      --json "$OUT/allreduce_new.json" $fi_flag
    if [ -d .baseline/opfuse ]; then
      step allreduce_old "$(fits 100 90)" env PYTHONPATH=.baseline OPFUSE_CACHE_DIR="$PWD/.baseline/.opfuse-cache" \
        python3 .baseline/bench/allreduce_norm.py --quick --tokens 1 4 16 64 256 --no-flashinfer \
        --json "$OUT/allreduce_old.json"
    fi
    step timeline "$(fits 80 30)" python3 bench/allreduce_timeline.py --world 2 --hidden 8192 --tokens 1 4 16 64 \
      --json "$OUT/timeline.json"
    tests lamport_kernels "$(fits 200 0)" -q --maxfail=3 tests/gpu/test_residual_norm_lamport.py
    final_summary() {
      grep -E "^(measured ceilings|not measured)" "$OUT/allreduce_new.log" 2>/dev/null | sort -u | cut -c1-300
      for name in allreduce_new allreduce_old; do
        echo "=== $name"; grep -E "^(\||summary|targets)" "$OUT/$name.log" 2>/dev/null | grep -v "^|---" | cut -c1-260
      done
      echo "=== timeline"; cat "$OUT/timeline.log" 2>/dev/null | grep -v "^\[" | cut -c1-330
    }
    ;;
  s22-ar-next)
    # Issue 30, second call (2 GPUs, ~9 min; modules prebuilt and carried): the peer addresses in the
    # kernels' parameters and PDL on by default: protocol tests, the full quick table (FlashInfer
    # column), the one-shot's timeline over the packs each block pushes, decode with and without PDL.
    END=${AR_BUDGET_S:-560}
    tests kernels "$(fits 150 450)" -q --maxfail=3 tests/gpu/test_residual_norm_kernels.py \
      -k "oneshot or grid or peer_kernels or skips"
    tests lamport_kernels "$(fits 120 420)" -q --maxfail=3 tests/gpu/test_residual_norm_lamport.py
    tests residual_norm_dist "$(fits 90 380)" -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    flashinfer_checked 330
    step allreduce_quick "$(fits 150 240)" python3 bench/allreduce_norm.py --quick --json "$OUT/allreduce_quick.json" $fi_flag
    step timeline "$(fits 100 170)" python3 bench/allreduce_timeline.py --world 2 --hidden 8192 --tokens 1 4 16 64 \
      --pdl on --push-packs 0 32 64 256 1024 --json "$OUT/timeline.json"
    step decode_pdl "$(fits 200 0)" python3 bench/model.py --world 2 --cases decode --decode 1 8 --pdl-ab --profile \
      --json "$OUT/decode_pdl.json"
    final_summary() {
      grep -E "^(measured ceilings|not measured)" "$OUT/allreduce_quick.log" 2>/dev/null | sort -u | cut -c1-300
      echo "=== allreduce_quick"; grep -E "^(\||summary|targets)" "$OUT/allreduce_quick.log" 2>/dev/null \
        | grep -v "^|---" | cut -c1-250
      echo "=== timeline"; grep -vE "^\[|Warning|enable\(" "$OUT/timeline.log" 2>/dev/null | cut -c1-300
      echo "=== decode"; grep -E "^(\| (decode|2)|relative|note)" "$OUT/decode_pdl.log" 2>/dev/null | cut -c1-300
    }
    ;;
  s22-ar-1gpu)
    # Issue 30 on one GPU (~2 min): the clear-on-read one-shot's protocol tests on simulated ranks,
    # both poll depths, the FP8 epilogue, the Lamport kernel, the bounded waits.
    tests kernels 150 -q --maxfail=3 tests/gpu/test_residual_norm_kernels.py
    step kernels_depth2 90 env OPFUSE_ONESHOT_POLL_DEPTH=2 python3 -m pytest -q --maxfail=3 \
      tests/gpu/test_residual_norm_kernels.py -k "oneshot or grid or skips"
    tests fp8_ar_kernels 90 -q --maxfail=3 tests/gpu/test_fp8_allreduce_norm_kernels.py
    tests lamport_kernels 120 -q --maxfail=3 tests/gpu/test_residual_norm_lamport.py
    tests peer_timeout 60 -q tests/gpu/test_peer_timeout.py
    ;;
  s22-sim)
    # Issue 30 on one GPU (~3 min): the peer kernels on simulated ranks (bench/allreduce_simulated.py),
    # the previous main (.baseline/, PDL off) against this tree without PDL, with it, and with the
    # two-deep poll: the kernels' own costs (call state, clears, polls, norm) without NVLink.
    sizes=(--hidden 8192 5120 --tokens 1 4 16 64 256 --kinds oneshot lamport)
    if [ -d .baseline/opfuse ]; then
      step sim_old 120 env PYTHONPATH=.baseline OPFUSE_CACHE_DIR="$PWD/.baseline/.opfuse-cache" OPFUSE_PDL=0 \
        python3 .baseline/bench/allreduce_simulated.py "${sizes[@]}" --label previous
    fi
    step sim_new_nopdl 120 env OPFUSE_PDL=0 python3 bench/allreduce_simulated.py "${sizes[@]}" --label new
    step sim_new 120 python3 bench/allreduce_simulated.py "${sizes[@]}" --label new
    step sim_new_depth2 120 env OPFUSE_ONESHOT_POLL_DEPTH=2 python3 bench/allreduce_simulated.py "${sizes[@]}" \
      --label "new, poll depth 2"
    final_summary() {
      for name in sim_old sim_new_nopdl sim_new sim_new_depth2; do
        echo "=== $name"; grep -E "^(\||simulated)" "$OUT/$name.log" 2>/dev/null
      done
    }
    ;;
  s23-gqa)
    # Issue 26 on one GPU (~6 min): decode attention reading the key/value cache unrepeated
    # (grouped queries folded): the GPU test, then world-1 decode (the hidden-8192 model unsharded)
    # against torch.compile and against opfuse with the repeat kept, with kernel tables.
    tests gqa 240 -q tests/gpu/test_grouped_attention_gpu.py
    step decode_gqa 420 python3 bench/model.py --world 1 --cases decode --decode 1 8 --gqa-ab --profile
    final_summary() { grep -E "^\||took|relative" "$OUT/decode_gqa.log" | tail -60; }
    ;;
  s28-ar)
    # Issue 30 (2 GPUs, ~8 min; modules prebuilt, carry .opfuse-cache and .thirdparty): the one-shot
    # pushing in row-ordered waves (rows arrive in the order blocks reduce them; session 27's timeline
    # at 256 tokens had ~4.6 us between the last arrival and the end). Protocol tests at world 2, the
    # quick table with FlashInfer, the timeline at 64 / 256 tokens, then the crossover sweep at world 2
    # and the table fitted from it (copied into opfuse/families/residual_norm/ to ship it).
    END=${AR_BUDGET_S:-540}
    tests residual_norm_dist "$(fits 90 450)" -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    tests peer_timeout "$(fits 60 390)" -x -q tests/gpu/test_peer_timeout.py
    flashinfer_checked 330
    step allreduce_quick "$(fits 120 210)" python3 bench/allreduce_norm.py --quick --json "$OUT/allreduce_quick.json" $fi_flag
    step timeline "$(fits 40 170)" python3 bench/allreduce_timeline.py --world 2 --hidden 8192 --tokens 64 256 \
      --pdl on --poll-depth 1 --json "$OUT/timeline.json"
    crossover_sweep "$(fits 140 30)" "$(fits 30 0)" 2
    final_summary() {
      grep -E "^(measured ceilings|not measured)" "$OUT/allreduce_quick.log" 2>/dev/null | sort -u | cut -c1-300
      echo "=== allreduce_quick"; sed -n '/^summary/,$p' "$OUT/allreduce_quick.log" 2>/dev/null | grep -v "^|---" | cut -c1-250
      echo "=== timeline"; grep -vE "^\[|Warning|enable\(" "$OUT/timeline.log" 2>/dev/null | cut -c1-300
      show crossover_sweep crossover_table
    }
    ;;
  s28-fp8-rs)
    # 2 GPUs (~4 min; issue 27): FP8 (pow2) train-sp without CUDA graphs, where 2048 tokens are
    # host-bound (s27-x2: 0.98x of torch.compile bf16; the FP8 GEMM + reduce-scatter over peer memory
    # ~800 us of CPU per call): 'opfuse fp8' against 'opfuse fp8:nccl-rs' (the FP8 GEMM, then NCCL's
    # reduce-scatter) and torch.compile bf16 in one process, 2048 and 8192 tokens.
    step fp8_rs 400 python3 bench/model.py --world 2 --cases train-sp --train 2048 8192 --train-batch 1 \
      --fp8 tensor-pow2 --variants "opfuse fp8:nccl-rs" --no-aa
    final_summary() { model_lines fp8_rs | grep -v "^| [0-9]"; }
    ;;
  s28-train)
    # 2 GPUs (~7 min; issues 30 and 26): the one-shot's kernel tests on simulated ranks after the
    # row-ordered pushes (s28-ar ran the world-2 protocol tests), then the kernel table per variant of
    # train-tp and train-sp 2048 at world 2 (compile / opfuse; no profile since session 16-20 on H200):
    # where each step's time goes next to its GEMMs-alone floor.
    END=${TRAIN_BUDGET_S:-540}
    tests kernels "$(fits 150 330)" -x -q tests/gpu/test_residual_norm_kernels.py
    step train_profile "$(fits 330 0)" python3 bench/model.py --world 2 --cases train-tp train-sp --train 2048 \
      --train-batch 1 --no-aa --profile
    final_summary() { model_lines train_profile | grep -v "^| [0-9]"; grep -A16 "GPU time per step" "$OUT/train_profile.log" | cut -c1-200; }
    ;;
  s28-clocks)
    # 2 GPUs (~2 min; issue 26): whether the timed training steps run at lower clocks than the
    # profiled ones (s28-train: timed train-tp 2048 steps 0.9-1.5 ms longer than the profiler's GPU
    # wall of the same steps, both variants). nvidia-smi samples SM clock, power and utilisation every
    # 100 ms while bench/model.py times train-tp 2048 (compile, opfuse); the summary gives the clock
    # and power quantiles of the busy samples per GPU, against the clock at rest.
    if [ -z "${DRY:-}" ]; then
      nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.max.sm,power.draw,power.limit,utilization.gpu,temperature.gpu \
        --format=csv,noheader,nounits -lms 100 > "$OUT/clocks.csv" 2>&1 &
      sampler=$!
    fi
    step train_tp "300" python3 bench/model.py --world 2 --cases train-tp --train 2048 --train-batch 1 --no-aa
    [ -z "${DRY:-}" ] && kill "$sampler" 2>/dev/null
    final_summary() { model_lines train_tp | grep -v "^| [0-9]"; python3 - "$OUT/clocks.csv" <<'PY'
import statistics, sys
rows = [[c.strip() for c in line.split(",")] for line in open(sys.argv[1]) if line.count(",") >= 7]
for gpu in sorted({r[1] for r in rows}):
    mine = [r for r in rows if r[1] == gpu]
    busy = [r for r in mine if r[6].isdigit() and int(r[6]) >= 90]
    rest = [r for r in mine if r[6].isdigit() and int(r[6]) == 0]
    def q(rs, i):
        v = sorted(float(r[i]) for r in rs)
        return "-" if not v else f"{v[len(v) // 10]:.0f} / {statistics.median(v):.0f} / {v[-1 - len(v) // 10]:.0f}"
    print(f"gpu {gpu}: {len(busy)} busy samples (util >= 90%) of {len(mine)}; SM MHz p10/p50/p90 busy {q(busy, 2)}, "
          f"at rest {q(rest, 2)} (max {mine[0][3]}); power W busy {q(busy, 4)} (limit {mine[0][5]}); temp C busy {q(busy, 7)}")
PY
    }
    ;;
  s29-fp8-aten)
    # One GPU (~9 min; issue 27): the FP8 producers (add + norm + quantize) written as aten ops for
    # Inductor in graphs compiled without CUDA graphs (opfuse.config.fp8_aten=auto) against opfuse's
    # kernels behind custom ops ('opfuse fp8:norm-kernels', fp8_aten=never), on the 16-layer small
    # model (hidden 2048) at world 1 where FP8's host time decides (2.32x of torch.compile bf16 in
    # s26-fp8-batch); first the compile FP8 GPU tests (the graphed-vs-plain one compares the two forms).
    END=${FP8_ATEN_BUDGET_S:-570}
    tests compile_fp8_gpu "$(fits 170 330)" -q tests/gpu/test_compile_fp8_moe.py
    step fp8_small "$(fits 330 0)" python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --variants "opfuse fp8:norm-kernels" --no-aa
    final_summary() { tail -3 "$OUT/compile_fp8_gpu.log"; model_lines fp8_small | grep -v "^| [0-9]"; }
    ;;
  s28-host)
    # One GPU (~2 min; issue 27): the cached Triton launches against Triton's own path, alternating
    # A B B A over 8 rounds (sessions 27 and 28 each timed them once, in one order, and disagreed).
    step host_cost 150 python3 bench/host_cost.py --rounds 8
    final_summary() { sed -n '/^torch /,$p' "$OUT/host_cost.log"; }
    ;;
  s27-launch)
    # 1-2 GPUs (~8 min; issue 27): opfuse's Triton kernels through cached launches
    # (opfuse/runtime/triton_launch.py) and the amax all-reduce as one functional collective. Host us
    # per call with the cache and through Triton's own path, and torch.profiler's table of each cast
    # (session 27: a weight cast's ~150 us moved with neither its launches nor its bytes); then the
    # FP8 step where host time decides, 'opfuse fp8' alone in its process with the cache and without
    # (OPFUSE_TRITON_LAUNCH_CACHE=0): on 2 GPUs train-sp 2048 of the hidden-8192 model (0.98x of
    # torch.compile bf16 in s27-x2, host-bound), on one the 16-layer small model's train-tp 2048
    # (2.32x in s26-fp8-batch). The small model's case takes ~200 s with every variant from cold
    # caches (session 27's first try at 150 s timed out): hence one variant per run. GPU tests:
    # s27-launch-tests.
    END=${LAUNCH_BUDGET_S:-560}
    step host_cost 120 python3 bench/host_cost.py --profile
    world=$(python3 -c "import torch; print(min(2, torch.cuda.device_count()))")
    if [ "$world" = 2 ]; then
      model_args=(--world 2 --cases train-sp --train 2048 --train-batch 1 --fp8 tensor-pow2 --only "opfuse fp8")
    else
      model_args=(--world 1 --shape small --cases train-tp --train 2048 --train-batch 1 --fp8 tensor-pow2 \
        --only "opfuse fp8")
    fi
    step fp8_cached "$(fits 230 230)" python3 bench/model.py "${model_args[@]}"
    export OPFUSE_TRITON_LAUNCH_CACHE=0
    step fp8_uncached "$(fits 230 0)" python3 bench/model.py "${model_args[@]}"
    final_summary() { sed -n '/^torch /,$p' "$OUT/host_cost.log"; grep -A22 "^profile of" "$OUT/host_cost.log" | cut -c1-200
      model_lines fp8_cached fp8_uncached | grep -v "^| [0-9]"; }
    ;;
  s27-launch-tests)
    # One GPU (~6 min): the GPU tests of every kernel launched through opfuse/runtime/triton_launch.py
    # (session 27: 259 of them passed before a 200 s limit, then these 55 in a second call).
    tests launch_gpu 420 -q tests/gpu/test_triton_launch.py tests/gpu/test_fp8.py \
      tests/gpu/test_compile_fp8_moe.py tests/gpu/test_grouped_attention_gpu.py tests/gpu/test_grouped.py
    final_summary() { tail -3 "$OUT/launch_gpu.log"; }
    ;;
  s27-x2)
    # 2 GPUs (~7 min; issues 26 and 27 at world 2, after s24-table and s22-ar-clear): the 16-layer small
    # model (hidden 2048, host time decides) at decode 1 / 8 and train-tp / train-sp 2048; then FP8
    # (pow2 weights, casts batched) train-tp and train-sp at 2048 / 8192 tokens on the hidden-8192 model
    # against torch.compile bf16 without CUDA graphs.
    step small2 300 python3 bench/model.py --world 2 --shape small --cases decode train-tp train-sp --decode 1 8 \
      --decode-sync --train 2048 --train-batch 1
    step fp8_w2 240 python3 bench/model.py --world 2 --cases train-tp train-sp --train 2048 8192 --train-batch 1 \
      --fp8 tensor-pow2 --no-aa
    final_summary() { model_lines small2 fp8_w2 | grep -v "^| [0-9]"; sed -n '/^summary/,$p' "$OUT/small2.log"; }
    ;;
  s26-small2)
    # 2 GPUs (~4 min; issue 26 "never slower" at world 2): the 16-layer small model (hidden 2048) where
    # host time decides: decode at batch 1 / 8 with and without the host reading each token, train-tp and
    # train-sp at 2048 tokens with the A/A control. Run after s24-table (the default table at world 2).
    step small2 500 python3 bench/model.py --world 2 --shape small --cases decode train-tp train-sp --decode 1 8 \
      --decode-sync --train 2048 --train-batch 1
    final_summary() { model_lines small2 | grep -v "^| [0-9]"; sed -n '/^summary/,$p' "$OUT/small2.log"; }
    ;;
  s26-fp8-batch)
    # One GPU (~6 min; issue 27): the FP8 quantizer and compile GPU tests (the address-table launch of
    # same-shape weights: bytes, hints, CUDA graphs with and without a table made before the capture);
    # then the 16-layer FP8 (pow2) train-tp 2048 step without CUDA graphs, where 112 weight casts a
    # step made it host-bound (2.86x of torch.compile bf16): casts batched per shape or each alone.
    tests fp8_gpu 200 -q tests/gpu/test_fp8.py tests/gpu/test_compile_fp8_moe.py tests/gpu/test_graph_pool.py
    step fp8_small 300 python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --variants "opfuse fp8:unbatched" --no-aa
    final_summary() { model_lines fp8_small | grep -v "^| [0-9]"; }
    ;;
  s26-fp8-profile)
    # One GPU (~3 min; issue 27): where the 16-layer FP8 step's host time goes now that its weight
    # casts are batched (2.32x of torch.compile bf16 without CUDA graphs): opfuse fp8 alone, with the
    # host profile's top functions and the aten ops' own CPU time.
    export OPFUSE_HOST_PROFILE_TOP=30 OPFUSE_HOST_PROFILE_OPS=1
    step fp8_profile 200 python3 bench/model.py --world 1 \
      --shape small --cases train-tp --train 2048 --train-batch 1 --fp8 tensor-pow2 --only "opfuse fp8" --profile
    final_summary() { grep -vE "^\[|^ *$" "$OUT/fp8_profile.log" | grep -A200 "host profile" | head -150; }
    ;;
  s26-host-cost)
    # One GPU (~1 min; issue 27): what is left of FP8's host time per step: torch._scaled_mm's host cost
    # per call against torch.mm's, and a weight cast alone against 16 in one call.
    step host_cost 90 python3 bench/host_cost.py
    final_summary() { cat "$OUT/host_cost.log"; }
    ;;
  s26-fp8-graphs)
    # One GPU (~7 min; issue 27): the same 16-layer FP8 step under CUDA graphs (batched casts must not
    # cost there: same bytes, fewer launches); the 2-layer hidden-8192 FP8 train-tp 2048 (default mode).
    step fp8_small_graphs 240 python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --variants "opfuse fp8:unbatched" --train-mode reduce-overhead --no-aa
    step fp8_large 200 python3 bench/model.py --world 1 --cases train-tp --train 2048 --train-batch 1 \
      --fp8 tensor-pow2 --variants "opfuse fp8:unbatched" --no-aa
    final_summary() { model_lines fp8_small_graphs fp8_large | grep -v "^| [0-9]"; }
    ;;
  s25-final)
    # One GPU (~5.5 min): after "a standalone add + norm is left to Inductor": the compile-backend GPU
    # tests, the 16-layer train-tp 2048 step (was 1.20x of torch.compile), the 2-layer decode at
    # batch 1 / 8 (world 1: its 5 add + norms now Inductor's).
    tests compile_gpu 75 -q tests/gpu/test_compile_backend.py
    step train_small 150 python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1
    step decode 90 python3 bench/model.py --world 1 --cases decode --decode 1 8
    final_summary() { model_lines train_small decode | grep -v "^| [0-9]"; }
    ;;
  s25-small-train)
    # One GPU (~9 min; "never slower"): the 16-layer small model's train-tp 2048 step, where opfuse bf16
    # measured 1.08x of torch.compile (s25-fp8-small): which fusion costs it (no add + norm, no rule at
    # all, no merged projections; A/A control); then FP8 (pow2) and bf16 under CUDA graphs.
    step train_small_variants 300 python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1 --variants opfuse:no-norm opfuse:no-fuse opfuse:no-merge
    step fp8_small_graphs 240 python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --train-mode reduce-overhead --no-aa
    final_summary() { model_lines train_small_variants fp8_small_graphs | grep -v "^| [0-9]"; }
    ;;
  s25-host2)
    # One GPU (~5 min): the compile-path GPU tests after the cheap layout guard and packed-parameter
    # check; then the 16-layer decode again (host read per token or not, merged projections or not).
    tests compile_gpu 150 -q tests/gpu/test_compile_backend.py tests/gpu/test_fused_single_gpu.py \
      tests/gpu/test_compile_fp8_moe.py
    step decode_small 200 python3 bench/model.py --world 1 --shape small --cases decode --decode 1 8 --decode-sync \
      --merge-ab
    final_summary() { model_lines decode_small | grep -v "^| [0-9]"; }
    ;;
  s25-fp8-small)
    # One GPU (~5 min; issue 27, "never slower"): FP8 (pow2) train-tp on the 16-layer small model, where
    # GEMMs are small and host time can decide a step, with a kernel table and host profile per variant.
    step fp8_small 420 python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --no-aa --profile
    final_summary() { grep -E "^\||took|in all|relative|total own" "$OUT/fp8_small.log" | tail -60; }
    ;;
  s25-host)
    # One GPU (~8 min; issue 26, "never slower"): host time per call. Llama 3.2 1B's decoder (16 layers
    # of hidden 2048: small GEMMs, many layers) decoding at batch 1 and 8, the loop without host syncs
    # and with the host reading each token (--decode-sync), this tree and main before the cheap
    # packed-parameter check (.thirdparty/old: `git archive 6c9472a opfuse` + this tree's bench/ and
    # examples/); batch 1 again with host profiles; FP8 train-tp on the same model.
    step decode_small 200 python3 bench/model.py --world 1 --shape small --cases decode --decode 1 8 --decode-sync
    step decode_small_old 170 bash -c "cd .thirdparty/old && python3 bench/model.py --world 1 --shape small \
      --cases decode --decode 1 8 --decode-sync"
    step fp8_small 120 python3 bench/model.py --world 1 --shape small --cases train-tp --train 2048 \
      --train-batch 1 --fp8 tensor-pow2 --no-aa
    step decode_small_profile 100 python3 bench/model.py --world 1 --shape small --cases decode --decode 1 --profile
    final_summary() { model_lines decode_small decode_small_old fp8_small decode_small_profile | grep -v "^| [0-9]"; }
    ;;
  s24-fp8-profile)
    # One GPU (~3 min): the grouped-attention GPU tests (new kernel cases), then where an FP8 (pow2)
    # training step's time goes at world 1 (issue 27: kernel table per variant, train-tp 2048).
    tests gqa 90 -q tests/gpu/test_grouped_attention_gpu.py
    step fp8_profile 200 python3 bench/model.py --world 1 --cases train-tp --train 2048 --train-batch 1 \
      --fp8 tensor-pow2 --profile --no-aa
    final_summary() { grep -E "^\||took|in all" "$OUT/fp8_profile.log" | tail -90; }
    ;;
  s24-attention)
    # Issue 26 on one GPU (~3 min): decode_attention with a pipelined partial kernel (tiles of 64
    # positions) and a combine vectorised over the splits: the GPU tests, then world-1 decode at
    # batch 1 / 8 / 64 with kernel tables.
    tests gqa 90 -q tests/gpu/test_grouped_attention_gpu.py
    step decode_profile 300 python3 bench/model.py --world 1 --cases decode --decode 1 8 64 --profile
    final_summary() { grep -E "^\||took|in all|partial_kernel|combine_kernel" "$OUT/decode_profile.log" | tail -80; }
    ;;
  s24-decode-profile)
    # Issue 26 on one GPU (~2 min): where decode's time goes at world 1 with decode_attention (kernel
    # table per variant at batch 1 and 8), against the weight-streaming floor.
    step decode_profile 300 python3 bench/model.py --world 1 --cases decode --decode 1 8 --profile
    final_summary() { grep -E "^\||took|in all" "$OUT/decode_profile.log" | tail -80; }
    ;;
  s24-table)
    # Issue 26 item 6 (~6 min on 2 GPUs; 1 GPU: world 1): the full default table of bench/model.py
    # (decode 1/8/64, train-tp and train-sp at 2048/8192 tokens, batch 1/4) in one call, each case's
    # wall time and model-build time in the notes.
    world=$(python3 -c "import torch; print(min(2, torch.cuda.device_count()))")
    step table 560 python3 bench/model.py --world "$world"
    final_summary() { grep -E "^\||took|in all|relative" "$OUT/table.log" | tail -60; }
    ;;
  s24-gqa-auto)
    # One GPU (~5 min; issue 26): decode_attention as the default (auto): the grouped-attention GPU
    # tests, then world-1 decode at batch 64 and 1 (batch 8 measured in s24-1gpu) against the fold,
    # the repeat and torch.compile.
    tests gqa 90 -q tests/gpu/test_grouped_attention_gpu.py
    step decode_auto 420 python3 bench/model.py --world 1 --cases decode --decode 64 1 --gqa-ab
    final_summary() { grep -E "^\||took|relative" "$OUT/decode_auto.log" | tail -30; }
    ;;
  s24-1gpu)
    # One GPU (~6 min): the residual-norm kernel tests on the final C++ (the tuning-knob helper, the
    # split row's part_span, the dead peer while a row is split over a cluster), poll depth 2, the
    # grouped-attention GPU tests, then world-1 decode at batch 1 / 8 / 64 with repeat, fold and
    # opfuse's Triton decode_attention side by side (issue 26).
    tests kernels 120 -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fp8_allreduce_norm_kernels.py \
      tests/gpu/test_residual_norm_lamport.py
    step depth2 60 env OPFUSE_ONESHOT_POLL_DEPTH=2 python3 -m pytest -q tests/gpu/test_residual_norm_kernels.py \
      -k "oneshot or grid or skips or split"
    tests gqa 90 -q tests/gpu/test_grouped_attention_gpu.py
    step decode_attention 300 python3 bench/model.py --world 1 --cases decode --decode 1 8 64 --gqa-ab
    final_summary() { grep -E "^\||took|relative" "$OUT/decode_attention.log" | tail -30; }
    ;;
  s23-decode-attention)
    # Issue 26 on one GPU (~4 min): opfuse's decode_attention (Triton, split over the cache's
    # positions) against the fold and the repeat: the GPU tests, then world-1 decode at batch 1
    # and 8 (no profile, to fit the session's device time).
    tests gqa 150 -q tests/gpu/test_grouped_attention_gpu.py
    step decode_attention 300 python3 bench/model.py --world 1 --cases decode --decode 1 8 --gqa-ab
    final_summary() { grep -E "^\||took|relative" "$OUT/decode_attention.log" | tail -30; }
    ;;
  s23-final)
    # Issue 30 on one GPU (~3 min): the final kernels' GPU tests (residual-norm kernels with the
    # split-row test, FP8 epilogues, Lamport, poll depth 2), then simulated ranks, whole rows
    # (OPFUSE_ONESHOT_ROW_SPLIT=1) against the default, PDL off and on.
    tests kernels 240 -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fp8_allreduce_norm_kernels.py \
      tests/gpu/test_residual_norm_lamport.py
    step depth2 120 env OPFUSE_ONESHOT_POLL_DEPTH=2 python3 -m pytest -q tests/gpu/test_residual_norm_kernels.py \
      -k "oneshot or grid or skips or split"
    sizes=(--hidden 8192 5120 --tokens 1 4 16 64 256)
    step sim_whole_nopdl 120 env OPFUSE_PDL=0 OPFUSE_ONESHOT_ROW_SPLIT=1 python3 bench/allreduce_simulated.py \
      "${sizes[@]}" --label "whole rows, PDL off"
    step sim_split_nopdl 120 env OPFUSE_PDL=0 python3 bench/allreduce_simulated.py "${sizes[@]}" --label "split rows, PDL off"
    step sim_whole 120 env OPFUSE_ONESHOT_ROW_SPLIT=1 python3 bench/allreduce_simulated.py "${sizes[@]}" \
      --label "whole rows, PDL on"
    step sim_split 120 python3 bench/allreduce_simulated.py "${sizes[@]}" --timeline --label "split rows, PDL on"
    final_summary() {
      for name in sim_whole_nopdl sim_split_nopdl sim_whole sim_split; do
        echo "=== $name"; grep -E "^(\||simulated|rank 0)" "$OUT/$name.log" 2>/dev/null
      done
    }
    ;;
  s23-split)
    # Issue 30 on one GPU (~3 min): the one-shot with rows split over clusters (row_split) against
    # whole rows (OPFUSE_ONESHOT_ROW_SPLIT=1), simulated ranks, PDL off, with the epilogue stamps;
    # kernel tests (the new split test among them) and the FP8 epilogues first.
    tests kernels 200 -q --maxfail=3 tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fp8_allreduce_norm_kernels.py
    for split in 1 2 4 8; do
      step sim_split$split 120 env OPFUSE_PDL=0 OPFUSE_ONESHOT_ROW_SPLIT=$split python3 bench/allreduce_simulated.py \
        --hidden 8192 5120 --tokens 1 4 16 64 --timeline --label "PDL off, row split <= $split"
    done
    final_summary() {
      for split in 1 2 4 8; do
        echo "=== sim_split$split"; grep -E "^(\||simulated|rank 0)" "$OUT/sim_split$split.log" 2>/dev/null
      done
    }
    ;;
  s23-sim-stamps)
    # Issue 30 on one GPU (~1.5 min): the one-shot's row epilogue split by stamps inside finish_row
    # (residual added and h stored; the norm's block reduction; y stored), simulated ranks, PDL off.
    tests kernels 150 -q --maxfail=3 tests/gpu/test_residual_norm_kernels.py
    step sim_stamps 120 env OPFUSE_PDL=0 python3 bench/allreduce_simulated.py --hidden 8192 5120 \
      --tokens 1 4 16 64 256 --timeline --label "PDL off, epilogue stamps"
    final_summary() {
      echo "=== sim_stamps"; grep -E "^(\||simulated|rank 0)" "$OUT/sim_stamps.log" 2>/dev/null
    }
    ;;
  s22-sim-timeline)
    # Issue 30 on one GPU (~1.5 min): where the one-shot's own time goes without NVLink (simulated
    # ranks with rank 0's phase timeline), PDL off and on; then the SASS of the bf16 one-shot (one
    # pack per thread, no FP8 epilogue): where the epilogue's operand loads sit against the wait.
    tests kernels 150 -q --maxfail=3 tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fp8_allreduce_norm_kernels.py
    step sim_timeline_nopdl 120 env OPFUSE_PDL=0 python3 bench/allreduce_simulated.py --hidden 8192 5120 \
      --tokens 1 4 16 64 256 --timeline --label "PDL off"
    step sim_timeline 120 python3 bench/allreduce_simulated.py --hidden 8192 5120 --tokens 1 4 16 64 --timeline \
      --label "PDL on"
    step oneshot_sass 60 bash -c 'cd opfuse/families/residual_norm/csrc && nvcc -O3 -std=c++20 \
      --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I../../../runtime/csrc -cubin \
      -o /tmp/oneshot.cubin allreduce_oneshot.cu && cuobjdump -sass /tmp/oneshot.cubin | awk \
      "/Function : .*oneshot_kernelI13__nv_bfloat16Li1ELNS_9QuantModeE0/{f=1;next} /Function : /{f=0} f" \
      | grep -nE "LDG|STG|BAR|SHFL|BRA|GLOBALTIMER|EXIT|CCTL|MEMBAR|LDL|STL|ERRBAR"'
    final_summary() {
      for name in sim_timeline_nopdl sim_timeline; do
        echo "=== $name"; grep -E "^(\||simulated|rank 0)" "$OUT/$name.log" 2>/dev/null
      done
      echo "=== oneshot_sass"; head -150 "$OUT/oneshot_sass.log"
    }
    ;;
  s22-ar-clear)
    # Issue 30, third call (2 GPUs, ~8 min; modules prebuilt and carried): the one-shot with two
    # buffers cleared as they are read, and its two-deep poll (OPFUSE_ONESHOT_POLL_DEPTH=2) against
    # the default: protocol tests (both depths, FP8 epilogue, bounded waits), the quick table
    # (FlashInfer column; ranks aligned on the GPU before each timed replay), the depth-2 table at
    # 1-256 tokens, the timeline of both depths.
    # (The single-GPU protocol tests of this version passed in s22-ar-1gpu.)
    END=${AR_BUDGET_S:-400}
    tests residual_norm_dist "$(fits 90 330)" -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    tests lamport_dist "$(fits 100 290)" -x -q tests/gpu/test_residual_norm_lamport_dist.py -k "2]"
    tests peer_timeout "$(fits 60 260)" -x -q tests/gpu/test_peer_timeout.py
    flashinfer_checked 220
    step allreduce_quick "$(fits 120 140)" python3 bench/allreduce_norm.py --quick --json "$OUT/allreduce_quick.json" $fi_flag
    step allreduce_depth2 "$(fits 80 80)" env OPFUSE_ONESHOT_POLL_DEPTH=2 python3 bench/allreduce_norm.py --quick \
      --tokens 1 4 16 64 256 --no-flashinfer --json "$OUT/allreduce_depth2.json"
    step timeline "$(fits 80 0)" python3 bench/allreduce_timeline.py --world 2 --hidden 8192 --tokens 1 16 64 256 \
      --pdl on --poll-depth 1 2 --json "$OUT/timeline.json"
    final_summary() {
      grep -E "^(measured ceilings|not measured)" "$OUT/allreduce_quick.log" 2>/dev/null | sort -u | cut -c1-300
      for name in allreduce_quick allreduce_depth2; do
        echo "=== $name"; sed -n '/^summary/,$p' "$OUT/$name.log" 2>/dev/null | grep -v "^|---" | cut -c1-250
      done
      echo "=== timeline"; grep -vE "^\[|Warning|enable\(" "$OUT/timeline.log" 2>/dev/null | cut -c1-300
    }
    ;;
  oneshot)
    tests kernels 240 -x -q tests/gpu/test_residual_norm_kernels.py
    tests peer_timeout 120 -x -q tests/gpu/test_peer_timeout.py
    tests residual_norm_dist 200 -x -q tests/gpu/test_residual_norm_dist.py -k "2]"
    step allreduce_bench 200 python3 bench/allreduce_norm.py --world 2 --hidden 8192 5120 \
      --tokens 1 16 64 256 1024 --json "$OUT/allreduce_norm.json" --no-flashinfer
    final_summary() { show allreduce_bench; }
    ;;
  nvidia-libs)
    install_wheels || echo "no wheels in .whl/ (carry them: docs/guide.md, optional NVIDIA libraries)"
    export PYTHONPATH=.:/tmp/site OPFUSE_EXPECT_NVIDIA_LIBS=1
    step doctor 90 python3 -m opfuse doctor
    tests nvidia_tests 300 -q -rs tests/gpu/test_nvidia_libs.py
    step nvidia_bench 240 python3 bench/nvidia_libs.py --tokens 1 128 2048 8192 --world 2 --m 512 2048 8192 \
      --json "$OUT/nvidia_libs.json"
    grep -E "^  (cuDNN frontend|cuBLASMp|    implementation)" "$OUT/doctor.log"
    grep -E "^(note:|library:|cudnn faster|cublasmp faster)" "$OUT/nvidia_bench.log"
    ;;
  fp8)
    tests fp8_tests 300 -x -q tests/gpu/test_fp8.py
    step fp8_bench 300 python3 bench/fp8.py --world 1 --json "$OUT/fp8_w1.json"
    ;;
  kernels-1gpu)
    tests kernels 300 -x -q tests/gpu/test_residual_norm_kernels.py tests/gpu/test_fused_single_gpu.py
    tests fp8_ar_kernels 200 -x -q tests/gpu/test_fp8_allreduce_norm_kernels.py
    tests fp8_tests 200 -x -q tests/gpu/test_fp8.py
    install_wheels
    PYTHONPATH=.:/tmp/site step norms_bench 200 python3 bench/nvidia_libs.py --part norms --tokens 1 128 2048 8192 --json "$OUT/norms.json"
    final_summary() { show norms_bench; }
    ;;
  layernorm-backward)
    tests norm_kernels 150 -q tests/gpu/test_residual_norm_kernels.py -k "backward or argument"
    tests norm_programs 150 -q tests/gpu/test_fused_single_gpu.py -k "norm"
    step norms_bench 200 python3 bench/nvidia_libs.py --part norms --tokens 1 128 2048 8192 --json "$OUT/norms.json"
    final_summary() { show norms_bench; }
    ;;
  fp8-allreduce)
    tests fp8_ar_kernels 150 -x -q tests/gpu/test_fp8_allreduce_norm_kernels.py
    tests fp8_ar_dist 200 -x -q tests/gpu/test_fp8_allreduce_norm_dist.py
    step fp8_ar_bench 200 python3 bench/fp8.py --world 2 --only block --quick
    final_summary() {
      echo "=== fp8 block (decode+next lists allreduce_add_rmsnorm_quantize)"
      grep -E "^(\||fusions)" "$OUT/fp8_ar_bench.log" | tail -14
    }
    ;;
  fp8-multi)
    tests fp8_dist_tests 200 -x -q tests/gpu/test_fp8_dist.py
    step fp8_bench 300 python3 bench/fp8.py --world 2 --json "$OUT/fp8_w2.json"
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
cat "$OUT/gpus.txt"
for f in "$OUT"/*.log; do echo "=== tail $(basename "$f")"; grep -vE '^\s*$' "$f" | grep -E 'Error|error|FAIL|assert|Traceback|^\|' | head -40; done
echo "=== summary"; printf '%s\n' "${summary[@]}"
if declare -F final_summary >/dev/null; then final_summary; fi
pack
