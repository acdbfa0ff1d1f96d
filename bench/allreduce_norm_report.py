"""The tables bench/allreduce_norm.py prints: one per world (times, ratios, GB/s per direction next to
the measured peer-copy rate, floors, errors) and the summary against issue 30's targets."""

from __future__ import annotations

__all__ = ["CALLS", "REPLAYS", "busbw_gbs", "fmt", "ratio", "table", "summary", "ratio_series"]

#: CUDA-graph replays: calls per graph, timed replays.
CALLS, REPLAYS = 40, 15  # 15: a 1-token call varied by ~0.5 us between two medians of 7 (session 22)


def busbw_gbs(message, world, us):
    """GB/s per direction: 2 (W - 1) / W x message bytes over ``us`` (None when not measured)."""
    if us is None or us <= 0 or world < 2:
        return None
    return 2 * (world - 1) / world * message / us / 1e3


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _rows(result) -> list:
    """A world's rows: runs record ``{"rows", "ceilings", "flashinfer"}``, older ones only the rows."""
    return result["rows"] if isinstance(result, dict) else result


def _gbs(r, world, key):
    return busbw_gbs(r["bytes"], int(world), r.get(key))


def _copy_gbs(result):
    ceilings = result.get("ceilings") if isinstance(result, dict) else None
    return ceilings["peer_egress_gbs"].get("copy_engine") if ceilings else None


def _columns(world, result):
    """(header, row key whose presence shows the column (None: always), cell function)."""
    copy = _copy_gbs(result)

    def addnorm(r):
        return (f"{fmt(ratio(r.get('addnorm_ours'), r.get('addnorm_compiled')), 2)} "
                f"({fmt(r.get('addnorm_ours'))}/{fmt(r.get('addnorm_compiled'))})")

    def floor(r):
        return f"{fmt(r['floor'])} ({r['floor_bound']})" if r.get("floor") is not None else "-"

    return [
        ("tokens", None, lambda r: str(r["tokens"])),
        ("bytes", None, lambda r: f"{r['bytes'] >> 10} KiB"),
        ("NCCL AR", None, lambda r: fmt(r.get("nccl_ar"))),
        ("NCCL+eager", "nccl_eager", lambda r: fmt(r.get("nccl_eager"))),
        ("NCCL+compiled", "nccl_compiled", lambda r: fmt(r.get("nccl_compiled"))),
        ("symm1+eager", "symm1_eager", lambda r: fmt(r.get("symm1_eager"))),
        ("symm2 AR", "symm2_ar", lambda r: fmt(r.get("symm2_ar"))),
        ("ours", None, lambda r: fmt(r.get("ours"))),
        ("impl", None, lambda r: str(r.get("ours_impl") or "-")),
        ("ours PDL", "ours_pdl", lambda r: fmt(r.get("ours_pdl"))),
        ("ours no PDL", "ours_nopdl", lambda r: fmt(r.get("ours_nopdl"))),
        ("ours/compiled", "nccl_compiled", lambda r: fmt(ratio(r.get("ours"), r.get("nccl_compiled")), 2)),
        ("ours/symm1", "symm1_eager", lambda r: fmt(ratio(r.get("ours"), r.get("symm1_eager")), 2)),
        ("ours/symm2", "symm2_ar", lambda r: fmt(ratio(r.get("ours"), r.get("symm2_ar")), 2)),
        ("ours 1shot", "ours_1shot", lambda r: fmt(r.get("ours_1shot"))),
        ("ours 2shotL", "ours_2shotL", lambda r: fmt(r.get("ours_2shotL"))),
        ("ours 2shot", "ours_2shot", lambda r: fmt(r.get("ours_2shot"))),
        ("ours nccl", "ours_nccl", lambda r: fmt(r.get("ours_nccl"))),
        ("AR ours", "ours_ar", lambda r: fmt(r.get("ours_ar"))),
        ("AR ours/NCCL", "ours_ar", lambda r: fmt(ratio(r.get("ours_ar"), r.get("nccl_ar")), 2)),
        ("add+norm ours/compiled", "addnorm_ours", addnorm),
        ("FlashInfer", None, lambda r: fmt(r.get("fi"))),
        ("FI path", None, lambda r: (r.get("fi_path") or "-") + ("" if r.get("fi_vllm", True) else "*")),
        ("ours/FI", None, lambda r: fmt(ratio(r.get("ours"), r.get("fi")), 2)),
        ("floor", None, floor),
        ("ours/floor", None, lambda r: fmt(ratio(r.get("ours"), r.get("floor")), 2)),
        # Issue 30's columns (runs from before it have no Lamport column, and none of these).
        ("ours/NCCL AR", "ours_2shotL", lambda r: fmt(ratio(r.get("ours"), r.get("nccl_ar")), 2)),
        ("GB/s ours", "ours_2shotL", lambda r: fmt(_gbs(r, world, "ours"), 0)),
        ("GB/s 2shotL", "ours_2shotL", lambda r: fmt(_gbs(r, world, "ours_2shotL"), 0)),
        ("GB/s NCCL AR", "ours_2shotL", lambda r: fmt(_gbs(r, world, "nccl_ar"), 0)),
        ("GB/s FI", "ours_2shotL", lambda r: fmt(_gbs(r, world, "fi"), 0)),
        ("peer copy GB/s", "ours_2shotL", lambda r: fmt(copy, 0)),
    ]


def table(world, result) -> str:
    """One table per hidden size (the layout tools/allreduce_table_to_json.py reads back). Columns
    a run did not measure (``--quick``, or recorded runs from before a column existed) are left out."""
    rows = _rows(result)
    ceilings = result.get("ceilings") if isinstance(result, dict) else None
    notes = []
    if ceilings:
        peer = ceilings["peer_egress_gbs"]
        notes.append(f"measured ceilings: peer egress {fmt(peer['best'], 0)} GB/s (NCCL all-gather "
                     f"{fmt(peer['nccl'], 0)}, copy engine {fmt(peer['copy_engine'], 0)}), HBM copy "
                     f"{fmt(ceilings['hbm_copy_gbs'], 0)} GB/s; FlashInfer: {result.get('flashinfer', '-')}; "
                     f"FI path * = vLLM would not call the fused kernel at that size; GB/s = 2 (W-1)/W x bytes / "
                     f"time, per direction")
    lines = []
    for hidden in dict.fromkeys(r["hidden"] for r in rows):
        these = [r for r in rows if r["hidden"] == hidden]
        columns = [c for c in _columns(world, result) if c[1] is None or any(c[1] in r for r in these)]
        lines += [f"\nworld {world}, {hidden} hidden, bf16, microseconds per call "
                  f"(CUDA graph of {CALLS} calls, median of {REPLAYS}, max over ranks)", *notes,
                  "| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
        for r in these:
            lines.append("| " + " | ".join(c[2](r) for c in columns) + " |")
        errs = [f"{r['tokens']}: " + ", ".join(f"{k} {v:.1e}" for k, v in r["err"].items())
                for r in these if r.get("err")]
        if errs:
            lines.append("relative errors vs float64 (tokens: output): " + "; ".join(errs))
        failed = [f"{r['tokens']} {k[:-4]}: {v}" for r in these for k, v in r.items()
                  if k.endswith("_why") and k != "fi_why" and r.get(k[:-4]) is None]
        if failed:
            lines.append("not measured (tokens column: why): " + "; ".join(failed))
    return "\n".join(lines)


# Issue 30's targets: <= 0.90x FlashInfer everywhere, <= 1.00x NCCL's all-reduce alone from 1024
# tokens up, one token in <= 4.5 us.
TARGET_FI, TARGET_NCCL, TARGET_NCCL_FROM, TARGET_ONE_TOKEN_US = 0.90, 1.00, 1024, 4.5
FORCED_SHORT = {"ours_1shot": "1shot", "ours_2shotL": "2shotL", "ours_2shot": "2shot", "ours_nccl": "nccl"}


def summary(results) -> str:
    """The headline table, printed last: opfuse against FlashInfer and NCCL's all-reduce alone, the
    achieved bandwidth per direction, the fastest forced implementation, and issue 30's targets."""
    lines = [f"\nsummary (us; targets: ours/FI <= {TARGET_FI}; ours/NCCL AR <= {TARGET_NCCL} from "
             f"{TARGET_NCCL_FROM} tokens; 1 token <= {TARGET_ONE_TOKEN_US} us; GB/s = 2 (W-1)/W x bytes / time)",
             "| world | hidden | tokens | FlashInfer | ours | impl | fastest forced | NCCL AR | ours/FI | ours/NCCL AR | "
             "GB/s ours | GB/s NCCL AR | peer copy GB/s | met |", "|" + "---|" * 14]
    met_count = total = 0
    for world, result in results.items():
        copy = _copy_gbs(result)
        for r in _rows(result):
            ours = r.get("ours")
            to_fi, to_nccl = ratio(ours, r.get("fi")), ratio(ours, r.get("nccl_ar"))
            checks = []
            if to_fi is not None:
                checks.append(to_fi <= TARGET_FI)
            if r["tokens"] >= TARGET_NCCL_FROM and to_nccl is not None:
                checks.append(to_nccl <= TARGET_NCCL)
            if r["tokens"] == 1 and ours is not None:
                checks.append(ours <= TARGET_ONE_TOKEN_US)
            if ours is None:
                checks.append(False)
            met = all(checks) if checks else None
            total += met is not None
            met_count += bool(met)
            forced = {FORCED_SHORT[k]: r[k] for k in FORCED_SHORT if r.get(k) is not None}
            best = min(forced, key=forced.get) if forced else None
            lines.append(f"| {world} | {r['hidden']} | {r['tokens']} | {fmt(r.get('fi'))} | {fmt(ours)} | "
                         f"{r.get('ours_impl') or '-'} | {f'{best} {forced[best]:.1f}' if best else '-'} | "
                         f"{fmt(r.get('nccl_ar'))} | {fmt(to_fi, 2)} | {fmt(to_nccl, 2)} | "
                         f"{fmt(_gbs(r, world, 'ours'), 0)} | {fmt(_gbs(r, world, 'nccl_ar'), 0)} | {fmt(copy, 0)} | "
                         f"{'-' if met is None else 'yes' if met else 'NO'} |")
    lines.append(f"targets met at {met_count} of {total} sizes")
    return "\n".join(lines)


def ratio_series(results) -> dict:
    """The chart: opfuse / (NCCL + compiled add+norm) per world and hidden size, against tokens;
    ``--quick`` runs (no compiled baseline): opfuse / NCCL's all-reduce alone."""
    series = {}
    for world, result in results.items():
        for r in _rows(result):
            base, name = (r.get("nccl_compiled"), "NCCL+compiled") if "nccl_compiled" in r else \
                (r.get("nccl_ar"), "NCCL AR alone")
            value = ratio(r.get("ours"), base)
            if value is not None:
                series.setdefault(f"world {world}, hidden {r['hidden']}: opfuse / {name}", []).append(
                    (r["tokens"], value))
    return series
