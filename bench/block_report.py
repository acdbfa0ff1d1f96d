"""The tables, summary rows and chart series of bench/block.py."""

from __future__ import annotations

TARGETS = {"decode_nn": 0.7, "decode_compile": 0.85, "train_nn": 1.15, "train_compile": 1.0,
           "decode_floor": 1.08, "train_floor": 1.05}


# Tables ---------------------------------------------------------------------------------------------------

def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def tables(world, result, opts) -> tuple[str, list]:
    rows = result["rows"]
    out = [f"\nworld {world}: hidden {opts['hidden']}, ffn {opts['ffn']}, {opts['act']}, bf16; microseconds per block "
           f"call (max over ranks); host = CPU time to issue one call"]
    summary = []
    decode = [r for r in rows if r["case"] == "decode"]
    if decode:
        out += ["", f"decode (forward only; graphs of {opts['calls_decode']} calls)",
                "| tokens | nn | nn:graph | compile | compile:graph | opfuse | opfuse:graph | graphed call | "
                "host nn | host opfuse | host graphed | opfuse:graph / nn:graph | / compile:graph | "
                "floor (GEMMs) | opfuse:graph / floor | graphed / floor | impls |",
                "|" + "---|" * 17]
        for r in decode:
            a, b = ratio(r.get("opfuse:graph"), r.get("nn:graph")), ratio(r.get("opfuse:graph"), r.get("compile:graph"))
            out.append(f"| {r['tokens']} | {fmt(r.get('nn'))} | {fmt(r.get('nn:graph'))} | {fmt(r.get('compile'))} | "
                       f"{fmt(r.get('compile:graph'))} | {fmt(r.get('opfuse'))} | {fmt(r.get('opfuse:graph'))} | "
                       f"{fmt(r.get('graphed'))} | {fmt(r.get('host:nn'))} | {fmt(r.get('host:opfuse'))} | "
                       f"{fmt(r.get('host:graphed'))} | {fmt(a, 2)} | {fmt(b, 2)} | {fmt(r.get('floor'))} | "
                       f"{fmt(ratio(r.get('opfuse:graph'), r.get('floor')), 2)} | "
                       f"{fmt(ratio(r.get('graphed'), r.get('floor')), 2)} | {r.get('impls', '')} |")
            for key, base, target in (("decode_nn", "nn:graph", TARGETS["decode_nn"]),
                                      ("decode_compile", "compile:graph", TARGETS["decode_compile"]),
                                      ("decode_floor", "floor", TARGETS["decode_floor"])):
                for what in ("opfuse:graph", "graphed"):
                    value = ratio(r.get(what), r.get(base))
                    summary.append((world, f"decode T={r['tokens']}", f"{what} / {base}", value, f"<= {target}",
                                    None if value is None else value <= target))
    train = [r for r in rows if r["case"].startswith("train")]
    if train:
        out += ["", f"train (forward + backward, grads of inputs and parameters; {opts['calls_train']} calls per batch)",
                "| mode | tokens | nn | nn:graph | compile | opfuse | graphed | host opfuse | host graphed | "
                "nn / opfuse | compile / opfuse | nn / graphed | floor (GEMMs) | opfuse / floor | graphed / floor | "
                "impls |",
                "|" + "---|" * 16]
        for r in train:
            out.append(f"| {r['case'][6:]} | {r['tokens']} | {fmt(r.get('nn'))} | {fmt(r.get('nn:graph'))} | "
                       f"{fmt(r.get('compile'))} | {fmt(r.get('opfuse'))} | {fmt(r.get('graphed'))} | "
                       f"{fmt(r.get('host:opfuse'))} | {fmt(r.get('host:graphed'))} | "
                       f"{fmt(ratio(r.get('nn'), r.get('opfuse')), 2)} | {fmt(ratio(r.get('compile'), r.get('opfuse')), 2)} | "
                       f"{fmt(ratio(r.get('nn'), r.get('graphed')), 2)} | {fmt(r.get('floor'))} | "
                       f"{fmt(ratio(r.get('opfuse'), r.get('floor')), 2)} | "
                       f"{fmt(ratio(r.get('graphed'), r.get('floor')), 2)} | {r.get('impls', '')} |")
            for what in ("opfuse", "graphed"):
                value = ratio(r.get(what), r.get("floor"))
                target = TARGETS["train_floor"]
                summary.append((world, f"{r['case']} T={r['tokens']}", f"{what} / floor", value, f"<= {target}",
                                None if value is None else value <= target))
                value = ratio(r.get("nn"), r.get(what))
                summary.append((world, f"{r['case']} T={r['tokens']}", f"nn / {what} (speedup)", value,
                                f">= {TARGETS['train_nn']}", None if value is None else value >= TARGETS["train_nn"]))
                value = ratio(r.get("compile"), r.get(what))
                summary.append((world, f"{r['case']} T={r['tokens']}", f"compile / {what} (speedup)", value,
                                f">= {TARGETS['train_compile']}",
                                None if value is None else value >= TARGETS["train_compile"]))
    errs = "; ".join(f"{r['case']} T={r['tokens']}: " + ", ".join(f"{k} {v:.1e}" for k, v in r.get("err", {}).items()
                                                                    if v is not None) for r in rows)
    out += ["", f"relative error vs torch.nn (outputs; train: max over outputs' grads): {errs}"]
    out += [f"note: {n}" for n in result["notes"]]
    out.append(f"(world {world} took {result['seconds']:.0f} s in the ranks)")
    return "\n".join(out), summary


def ratio_series(results) -> dict:
    """The chart: opfuse / torch.nn per world and case against tokens (decode: both as CUDA graphs;
    train: eager forward + backward)."""
    series = {}
    for world, result in results.items():
        for r in result["rows"]:
            ours, base = ("opfuse:graph", "nn:graph") if r["case"] == "decode" else ("opfuse", "nn")
            value = ratio(r.get(ours), r.get(base))
            if value is not None:
                series.setdefault(f"world {world} {r['case']}: {ours} / {base}", []).append((r["tokens"], value))
    return series
