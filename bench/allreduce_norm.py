"""All-reduce + residual add + RMSNorm: opfuse's kernels against NCCL, torch.compile, torch
symmetric memory and FlashInfer's fused kernel, in one run (ratios are only meaningful within a run).

    PYTHONPATH=. python3 bench/allreduce_norm.py --world 2 4 [--json FILE] [--plot FILE.png]
    PYTHONPATH=. python3 bench/allreduce_norm.py --world 2 4 --hidden 8192 5120 --tokens 1 64 256 1024 4096 8192
    PYTHONPATH=. python3 bench/allreduce_norm.py --quick     # issue 30's table, world 2, ~2-3 min on 2 GPUs
    python3 bench/allreduce_norm.py --from-json FILE --plot FILE.png   # redraw, no GPU needed

``--quick``: hidden 8192 and 5120 at 1, 4, 16, 64, 256, 1024, 4096, 8192 tokens (unless --hidden /
--tokens say otherwise), world 2 unless --world is given, and only the columns issue 30's targets
need: NCCL's all-reduce alone, opfuse (chosen and every implementation forced), FlashInfer, the
bandwidth columns; the torch.compile / eager / torch symmetric-memory baselines, opfuse's plain
all-reduce and the single-GPU add+norm columns are left out (they cost a torch.compile per size).

Method (as ../shared/ANCHORS.md): CUDA-graph replays of 40 back-to-back calls, median of 15
replays, max over ranks; bf16; hidden 8192; inputs reset (untimed) before each replay so in-place
baselines stay finite. Columns:
  nccl_ar        NCCL all-reduce alone (in place)
  nccl_eager     NCCL all-reduce + eager ``x + res`` + ``F.rms_norm``
  nccl_compiled  NCCL all-reduce + the add+norm under torch.compile (one Triton kernel writing the
                 new residual and the norm, as the fused ops do)
  symm1_eager    torch symm_mem one_shot_all_reduce + eager add+norm
  symm2_ar       torch symm_mem two_shot_all_reduce_ alone
  ours           opfuse AllReduceAddRMSNorm, implementation chosen by the dispatch table
  ours_pdl / ours_nopdl  (up to 1 MiB) the chosen program with its peer kernels launched with PDL /
                 without it, whichever is not the default (``OPFUSE_PDL``, on by default): PDL's share
  ours_1shot / ours_2shotL / ours_2shot / ours_nccl   the same with the implementation forced (where
                            capable; 2shotL = the pipelined Lamport two-shot of issue 30, 2shot = the
                            flag-based two-shot, nccl = NCCL all-reduce + opfuse's local add+norm kernel)
  fi             FlashInfer's fused all-reduce + residual + RMSNorm (TensorRT-LLM kernel) as vLLM
                 runs it on Hopper: fp32 accumulation, PDL, vLLM's one-shot/two-shot choice
                 (``fi_path``; ``fi_vllm``: whether vLLM would use the fused kernel at that size).
                 Needs the headers of tools/fetch_flashinfer.py (``.thirdparty/flashinfer/``) and
                 world 2, 4 or 8; otherwise skipped with the reason (bench/flashinfer_ar/).
  ours_ar        opfuse plain AllReduce (implementation chosen by the dispatch table)
  addnorm_*      single-GPU add+RMSNorm: opfuse kernel / eager / compiled (rank 0)
  floor          bandwidth floor of the fused op (bench/timing.py ``allreduce_floor_us``): the bytes
                 each rank must send over NVLink, 2 (W - 1) / W x message, over the peer egress
                 measured at the start of the run (best of NCCL all-gather and copy-engine pushes),
                 or the 4 messages of HBM traffic over the measured copy rate, whichever is larger
  err            relative error of opfuse's and FlashInfer's outputs against a float64 reference
  GB/s           achieved bandwidth per direction: the bytes an all-reduce without multicast must
                 send from each rank, 2 (W - 1) / W x message, over the time (NCCL's "bus
                 bandwidth"), for opfuse's chosen kernel (``gbs_ours``, and each forced one in the
                 JSON) and NCCL's all-reduce alone (``gbs_nccl``); next to them the peer copy
                 bandwidth measured at the start (``copy_engine`` of ``peer_egress_gbs`` in
                 bench/timing.py: every rank copy-engine pushes 32 MiB into every peer's symmetric
                 memory at once, bench/push_bandwidth.py's per-peer-stream mode) and NCCL's
                 all-gather egress. (The one-shot sends (W - 1) x message, more than this counts.)

Every opfuse measurement runs with a bounded peer wait (``--peer-timeout-ms``, default 20 s): a
kernel that loses a peer ends with opfuse.PeerTimeoutError (recorded in the row, the column left
empty) instead of hanging; after one, the remaining opfuse columns of the run are skipped on every
rank (the region is out of step with its peers).

torch.compile (torch 2.11): the add+norm is compiled once per size with static shapes (dynamo is
reset before each size; the default ``dynamic=None`` would otherwise switch to a dynamic-shape
kernel from the second size on, 10-14 % slower at >= 1024 tokens), default mode (Inductor's own
CUDA graphs stay off: the bench captures the compiled function into its own graph after the
warm-up calls have compiled it).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
import common  # noqa: E402  (bench/common.py)
from timing import graph_replay_us, median  # noqa: E402  (bench/timing.py)
from allreduce_norm_report import (CALLS, REPLAYS, busbw_gbs, ratio_series, summary,  # noqa: E402
                                   table)

EPS = 1e-6


def graph_time_us(fn, reset=None) -> float:
    """Median over REPLAYS of a CUDA graph holding CALLS calls of ``fn``, per call (microseconds),
    max over ranks."""
    value = torch.tensor([median(graph_replay_us(fn, CALLS, REPLAYS, reset=reset))], device="cuda")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def rms_block(hidden, dtype, reduce=True):
    return ops.Sequential(*([ops.AllReduce()] if reduce else []), ops.AddExtraInput(), ops.MakeExtraOutput(),
                          ops.RMSNorm(hidden, eps=EPS, dtype=dtype, device="cuda"))


def add_norm(a, r, w):
    """The add+norm the baselines compile: the new residual and its RMSNorm (both are outputs of
    the fused op, so the compiled kernel writes both too)."""
    h = a + r
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def compiled_for_this_size():
    """torch.compile of ``add_norm`` specialised to the next shape it sees (see the module docstring)."""
    torch._dynamo.reset()
    return torch.compile(add_norm)


def open_flashinfer(world, max_message):
    """(FlashInferFusion, None) or (None, the reason the column is skipped)."""
    try:
        from flashinfer_ar.build import FlashInferUnavailable
        from flashinfer_ar.fusion import FlashInferFusion
    except ImportError as error:
        return None, f"bench/flashinfer_ar not importable: {error}"
    try:
        return FlashInferFusion(dist.group.WORLD, max_message), None
    except FlashInferUnavailable as error:
        return None, str(error).splitlines()[0][:200]
    except Exception as error:  # noqa: BLE001 - e.g. symmetric memory refused: the column is skipped, not the run
        return None, f"workspace setup failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"


def rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


#: The forced columns: implementation -> row key.
FORCED = (("cuda_oneshot", "ours_1shot"), ("cuda_twoshot_lamport", "ours_2shotL"), ("cuda_twoshot", "ours_2shot"),
          ("nccl+cuda", "ours_nccl"))


ERR_KEYS = ("ours_y", "ours_h", "fi_y", "fi_h") + tuple(f"{key}_y" for _, key in FORCED)
#: Up to this message the chosen kernel is also timed with PDL launches (``ours_pdl``): PDL's share.
PDL_COMPARE_MAX_BYTES = 1 << 20


class PeerHealth:
    """Whether every rank's peer-memory kernels are still in step: after a timeout on any rank,
    opfuse's columns are skipped on every rank (deciding together, so no rank waits alone in a
    collective of the timing code)."""

    def __init__(self):
        self.why = None

    def ok(self) -> bool:
        if self.why is None:
            local = 0.0
            try:
                opfuse.check_peers()
            except opfuse.PeerTimeoutError as error:
                local, self.why = 1.0, str(error).splitlines()[0][:200]
            if max_over_ranks_list([local])[0] > 0 and self.why is None:
                self.why = "a peer-memory wait timed out on another rank"
        return self.why is None


def measure_opfuse(row, key, health, fn):
    """``row[key]`` = ``fn()`` (us), or None with ``row[key + '_why']`` when it failed (the same on
    every rank: capability errors are; timeouts are caught by ``health`` before the next column)."""
    if not health.ok():
        row[key], row[key + "_why"] = None, f"skipped: {health.why}"
        return
    try:
        row[key] = fn()
    except Exception as error:  # noqa: BLE001 - not capable at this size, or a peer timed out
        row[key] = None
        row[key + "_why"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def worker(rank, world, opts, out_path):
    from torch.distributed import _symmetric_memory as symm_mem
    from timing import allreduce_floor_us, device_copy_gbs, peer_egress_gbs

    torch.manual_seed(1234 + rank)  # the partial sums x differ per rank
    # The residual and the norm's weight are replicated (every rank passes the same tensors: opfuse
    # checks it on the first call), so they come from a generator seeded alike on every rank.
    shared = torch.Generator(device="cuda").manual_seed(4321)
    opfuse.config.peer_timeout_ms = opts["peer_timeout_ms"]
    quick = opts["quick"]
    dtype = getattr(torch, opts["dtype"])
    group_name = dist.group.WORLD.group_name
    health = PeerHealth()
    rows = []
    ceilings = {"peer_egress_gbs": peer_egress_gbs(), "hbm_copy_gbs": max_over_ranks_min(device_copy_gbs())}
    element = torch.empty((), dtype=dtype).element_size()
    max_message = max(opts["hidden"]) * max(opts["tokens"]) * element
    if not opts["flashinfer"]:
        fi, fi_why = None, "--no-flashinfer"
    elif dtype == torch.float32:
        fi, fi_why = None, "float32: not built"
    else:
        fi, fi_why = open_flashinfer(world, max_message)
    for hidden in opts["hidden"]:
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=shared)).to(dtype)
        for tokens in opts["tokens"]:
            compiled_add_norm = None if quick else compiled_for_this_size()
            x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            res = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=shared)
            buf = torch.empty_like(x)
            reset_buf = lambda: buf.copy_(x)  # noqa: E731
            message = x.numel() * x.element_size()
            row = {"hidden": hidden, "tokens": tokens, "bytes": message, "err": {}, "quick": quick}
            row["floor"], row["floor_bound"] = allreduce_floor_us(message, world, ceilings["peer_egress_gbs"]["best"],
                                                                  ceilings["hbm_copy_gbs"])
            h_ref = x.double()
            dist.all_reduce(h_ref)
            h_ref += res.double()
            y_ref = F.rms_norm(h_ref, (hidden,), weight.double(), EPS)

            row["nccl_ar"] = graph_time_us(lambda: dist.all_reduce(buf), reset_buf)
            if not quick:
                symm = symm_mem.empty(tokens, hidden, dtype=dtype, device="cuda")
                symm_mem.rendezvous(symm, group_name)
                reset_symm = lambda: symm.copy_(x)  # noqa: E731

                def nccl_eager():
                    dist.all_reduce(buf)
                    F.rms_norm(buf + res, (hidden,), weight, EPS)

                def nccl_compiled():
                    dist.all_reduce(buf)
                    compiled_add_norm(buf, res, weight)

                def symm1_eager():
                    out = torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", group_name)
                    F.rms_norm(out + res, (hidden,), weight, EPS)

                row["nccl_eager"] = graph_time_us(nccl_eager, reset_buf)
                row["nccl_compiled"] = graph_time_us(nccl_compiled, reset_buf)
                row["symm1_eager"] = graph_time_us(symm1_eager, reset_symm)
                row["symm2_ar"] = graph_time_us(
                    lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name), reset_symm)
            with torch.no_grad():
                block = rms_block(hidden, dtype)
                with torch.no_grad():
                    block[-1].weight.copy_(weight)

                def ours():
                    y, h = block(x, res)
                    row["err"]["ours_y"], row["err"]["ours_h"] = rel_err(y, y_ref), rel_err(h, h_ref)
                    row["ours_impl"] = opfuse.compile(block, x, res).fusions[0].impl
                    return graph_time_us(lambda: block(x, res))

                measure_opfuse(row, "ours", health, ours)
                if message <= PDL_COMPARE_MAX_BYTES:
                    # The same program with its peer kernels launched the other way (captured so):
                    # with PDL when the default is without, and without when the default is with.
                    other = not opfuse.config.pdl

                    def ours_other_pdl():
                        with opfuse.config.override(pdl=other):
                            return graph_time_us(lambda: block(x, res))

                    measure_opfuse(row, "ours_pdl" if other else "ours_nopdl", health, ours_other_pdl)
                row.update(flashinfer_columns(fi, fi_why, world, x, res, weight, y_ref, h_ref, row["err"]))
                for impl, key in FORCED:
                    def forced_us(impl=impl):
                        # Forced one-shot / two-shots run past their automatic limits, to locate the
                        # crossovers. The timing stays inside the override: programs are cached per
                        # settings.
                        with opfuse.config.override(force_impl=f"allreduce_add_rmsnorm={impl}",
                                                    oneshot_max_bytes=32 << 20, twoshot_max_bytes=256 << 20):
                            forced = rms_block(hidden, dtype)
                            with torch.no_grad():
                                forced[-1].weight.copy_(weight)
                            y, _ = forced(x, res)
                            assert opfuse.compile(forced, x, res).fusions[0].impl == impl
                            row["err"][key + "_y"] = rel_err(y, y_ref)
                            return graph_time_us(lambda: forced(x, res))

                    measure_opfuse(row, key, health, forced_us)
                if not quick:
                    plain = ops.Sequential(ops.AllReduce())

                    def plain_us():
                        plain(x)
                        row["ours_ar_impl"] = opfuse.compile(plain, x).fusions[0].impl
                        return graph_time_us(lambda: plain(x))

                    measure_opfuse(row, "ours_ar", health, plain_us)
                    local = rms_block(hidden, dtype, reduce=False)
                    local(x, res)
                    row["addnorm_ours"] = graph_time_us(lambda: local(x, res))
                    row["addnorm_eager"] = graph_time_us(lambda: F.rms_norm(x + res, (hidden,), weight, EPS))
                    row["addnorm_compiled"] = graph_time_us(lambda: compiled_add_norm(x, res, weight))
            row["gbs_nccl"] = busbw_gbs(message, world, row["nccl_ar"])
            for key in ("ours", "fi") + tuple(k for _, k in FORCED):
                row["gbs_" + key] = busbw_gbs(message, world, row.get(key))
            # Max over ranks of every error, by a fixed list of keys (-1: not measured on that rank),
            # so the collective has the same length on every rank whatever failed where.
            worst = max_over_ranks_list([row["err"].get(k, -1.0) for k in ERR_KEYS])
            row["err"] = {k: v for k, v in zip(ERR_KEYS, worst) if v >= 0}
            rows.append(row)
            del h_ref, y_ref
            if rank == 0:  # the times too: a run cut by its time limit still shows what it measured
                times = ", ".join(f"{k} {row[k]:.1f}" for k in ("nccl_ar", "ours", "fi") + tuple(k for _, k in FORCED)
                                  if row.get(k) is not None)
                common.progress(f"world {world}: hidden {hidden}, {tokens} tokens done (us: {times}; "
                                f"chosen {row.get('ours_impl', '-')})")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"rows": rows, "ceilings": ceilings, "flashinfer": fi_why or "measured", "quick": quick},
                      handle)


def flashinfer_columns(fi, why, world, x, res, weight, y_ref, h_ref, err) -> dict:
    """The FlashInfer kernel on this size, with vLLM's one-shot/two-shot choice."""
    if fi is None:
        return {"fi": None, "fi_why": why}
    from flashinfer_ar.fusion import vllm_fuses, vllm_uses_oneshot

    tokens, hidden = x.shape
    message = x.numel() * x.element_size()
    oneshot = vllm_uses_oneshot(message, world)
    cols = {"fi_path": "1shot" if oneshot else "2shot", "fi_vllm": vllm_fuses(message, world)}
    why = fi.can_run(tokens, message, oneshot)
    if why:
        return {**cols, "fi": None, "fi_why": why}
    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)

    def call():
        fi(x, res, weight, EPS, norm_out, residual_out, oneshot=oneshot)

    try:
        call()  # argument errors come back as exceptions, the same on every rank
    except (ValueError, RuntimeError) as error:
        return {**cols, "fi": None, "fi_why": str(error).splitlines()[0][:200]}
    torch.cuda.synchronize()
    err["fi_y"], err["fi_h"] = rel_err(norm_out, y_ref), rel_err(residual_out, h_ref)
    cols["fi"] = graph_time_us(call)
    return cols


def max_over_ranks_list(values):
    t = torch.tensor(values, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def max_over_ranks_min(value):
    """The smallest ``value`` over ranks (a ceiling is as high as the slowest GPU's)."""
    return -max_over_ranks_list([-value])[0]


def main() -> int:
    parser = common.parser("allreduce_norm", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=None, help="default: 2 4 (--quick: 2)")
    parser.add_argument("--hidden", type=int, nargs="+", default=None, help="default: 8192 (--quick: 8192 5120)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="default: 1 8 32 128 512 2048 8192 (--quick: 1 4 16 64 256 1024 4096 8192)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-flashinfer", action="store_true", help="leave the FlashInfer column empty")
    parser.add_argument("--quick", action="store_true",
                        help="issue 30's table only: NCCL alone, opfuse (chosen and forced), FlashInfer, GB/s")
    parser.add_argument("--peer-timeout-ms", type=int, default=20_000,
                        help="bound on the peer kernels' waits (a lost peer becomes an error, not a hang)")
    args = parser.parse_args()
    if args.world is None:
        args.world = [2] if args.quick else [2, 4]
    if args.hidden is None:
        args.hidden = [8192, 5120] if args.quick else [8192]
    if args.tokens is None:
        args.tokens = [1, 4, 16, 64, 256, 1024, 4096, 8192] if args.quick else [1, 8, 32, 128, 512, 2048, 8192]

    def measure():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        measured = {}
        for world in common.worlds(args.world):
            common.progress(f"world {world}: {len(args.hidden) * len(args.tokens)} cases")
            opts = {"hidden": args.hidden, "tokens": args.tokens, "dtype": args.dtype,
                    "flashinfer": not args.no_flashinfer, "quick": args.quick,
                    "peer_timeout_ms": args.peer_timeout_ms}
            measured[str(world)] = common.run_ranks(worker, world, opts)
            print(table(world, measured[str(world)]), flush=True)  # as each world finishes
        return measured

    measuring = not args.from_json
    results = common.results(args, "allreduce_norm", min(args.world), measure)
    if results is None:
        return 0
    if not measuring:
        for world, result in results.items():
            print(table(world, result), flush=True)
    print(summary(results), flush=True)
    common.finish(args, results, series=ratio_series(results), xlabel="tokens",
                  ylabel="time ratio (< 1: opfuse faster)",
                  title="all-reduce + bias + residual + RMSNorm: opfuse / the NCCL baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
