"""Host overhead of a compiled ``ops.Sequential`` call against calling the same modules by hand.

    PYTHONPATH=. python3 bench/host_overhead.py [--device cpu|cuda] [--tokens 1] [--calls 2000] [--grad]
                                                [--json FILE] [--plot FILE.png] [--from-json FILE]

Tiny tensors, so op time is small and differences are Python cost per call. For the unfused and
the fused program of the same block:

* ``block(x, res)``: the compiled block as users call it (guard, then the program);
* ``program only``: the program's own callable (``Program.run``: its module calls, no guard);
* ``by hand``: the same modules the program runs, called one after the other by hand (for the
  unfused program: the block's basic ops; for the fused one: its fused modules and leftovers);
* ``added``: ``block(x, res)`` minus ``by hand``, opfuse's cost per call (target <= 10 us).

A second table times each fused module of the fused program against its implementation's
``forward`` called directly with the same arguments: the eager dispatch cost of a fused op.

Times are the process's CPU time per call (``time.process_time``), not wall time: on a shared
host, time spent descheduled is not this process's cost. Every variant is timed in turn, round
after round (``--rounds``), and the best round counts (noise only adds time; interleaving keeps
slow phases from favouring one row). With ``--device cuda`` each loop ends with a synchronize.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from timing import host_cpu_us as timed  # noqa: E402  (bench/timing.py)

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.machinery.fused_op import FusedOp  # noqa: E402


def block(hidden, device):
    return ops.Sequential(ops.RMSNorm(hidden, device=device), ops.Linear(hidden, 4 * hidden, device=device), ops.GELU(),
                          ops.Linear(4 * hidden, hidden, device=device), ops.AddExtraInput(), ops.MakeExtraOutput(),
                          ops.RMSNorm(hidden, device=device))


def by_hand(program):
    """The program's modules called one after the other by hand, as straight-line code (what a
    user would write; tuple outputs indexed in place)."""
    gm = program.graph_module
    names, consts, lines, params = {}, {}, [], []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            names[node] = f"a{len(params)}"
            params.append(names[node])
        elif node.op == "call_function":  # getitem of a module's tuple output
            src, index = node.args
            names[node] = f"{names[src]}[{index}]"
        elif node.op == "call_module":
            consts[f"m{len(consts)}"] = gm.get_submodule(node.target)
            names[node] = f"v{len(lines)}"
            lines.append(f"    {names[node]} = m{len(consts) - 1}({', '.join(names[a] for a in node.args)})")
        elif node.op == "output":
            lines.append(f"    return ({', '.join(names[a] for a in node.args[0])},)")
    source = f"def hand({', '.join(params)}):\n" + "\n".join(lines) + "\n"
    exec(compile(source, "<by hand>", "exec"), consts)  # noqa: S102 - straight-line calls of the program's modules
    return consts["hand"]


def fused_dispatch_cases(program, inputs):
    """``(name, module call, implementation call)`` for each fused module of ``program``: the
    module as the program calls it, and its implementation's ``forward`` called directly with the
    arguments the module hands to its custom op (recorded from one call)."""
    from opfuse.machinery import fused_op as registry

    recorded, original = [], registry.FusedCall.__call__

    def record(self, *args):
        recorded.append(args)
        return original(self, *args)

    cases = []
    for node in program.graph_module.graph.nodes:
        module = program.graph_module.get_submodule(node.target) if node.op == "call_module" else None
        if not isinstance(module, FusedOp):
            continue
        values = {n: v for n, v in zip((n for n in program.graph_module.graph.nodes if n.op == "placeholder"),
                                       inputs)}
        args = _node_inputs(program, node, values)
        recorded.clear()
        registry.FusedCall.__call__ = record
        try:
            module(*args)
        finally:
            registry.FusedCall.__call__ = original
        op_args = recorded[0]
        impl = module.implementation.forward
        cases.append((f"{module.name} ({module.impl})", lambda m=module, a=args: m(*a),
                      lambda f=impl, a=op_args[:-1]: f(*a)))
    return cases


def _node_inputs(program, target, values):
    """The values flowing into ``target`` for the placeholder ``values`` (runs the graph up to it)."""
    gm = program.graph_module
    for node in gm.graph.nodes:
        if node is target:
            return [values[a] for a in node.args]
        if node.op == "call_module":
            values[node] = gm.get_submodule(node.target)(*[values[a] for a in node.args])
        elif node.op == "call_function":
            values[node] = node.target(*[values[a] if isinstance(a, torch.fx.Node) else a for a in node.args])
    raise KeyError(target)


def main() -> int:
    parser = common.parser("host_overhead", __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--grad", action="store_true", help="inputs require grad (forward only is timed)")
    args = parser.parse_args()
    if args.from_json:
        report(common.load_json(args.from_json), args)
        return 0
    if args.device == "cuda" and common.skip_without_gpus("host_overhead --device cuda", 1):
        return 0
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    seq = block(args.hidden, args.device)
    x = torch.randn(args.tokens, args.hidden, device=args.device, requires_grad=args.grad)
    res = torch.randn(args.tokens, args.hidden, device=args.device)
    mode = torch.enable_grad if args.grad else torch.no_grad
    variants, programs = {}, {}
    with mode():
        for label, fuse in (("unfused program", False), ("fused program", True)):
            with opfuse.config.override(fuse=fuse):
                program = opfuse.compile(seq, x, res)
            programs[label] = program
            # The setting is part of the cache key: each variant runs under its own value.
            variants[label] = (fuse, {"block(x, res)": lambda: seq(x, res),
                                      "program only": lambda p=program: p.run(x, res),
                                      "by hand": lambda h=by_hand(program): h(x, res)})
        best = {}
        for _ in range(args.rounds):
            for label, (fuse, fns) in variants.items():
                with opfuse.config.override(fuse=fuse):
                    seq(x, res)  # arms the fast path for this setting
                    for name, value in timed(fns, args.calls, 1, sync).items():
                        best[(label, name)] = min(best.get((label, name), float("inf")), value)
        for label in variants:
            common.progress(f"{label} done")
        dispatch = []
        for case, module_call, impl_call in fused_dispatch_cases(programs["fused program"], (x, res)):
            got = timed({"module": module_call, "impl": impl_call}, args.calls, args.rounds, sync)
            dispatch.append({"op": case, "module": got["module"], "impl": got["impl"]})
        common.progress("fused op dispatch done")
    data = {"device": args.device, "tokens": args.tokens, "hidden": args.hidden, "calls": args.calls,
            "rounds": args.rounds, "grad": args.grad, "torch": torch.__version__,
            "rows": [{"path": label, "modules": len(programs[label].graph_module.graph.find_nodes(op="call_module")),
                      "block": best[(label, "block(x, res)")], "program": best[(label, "program only")],
                      "hand": best[(label, "by hand")]} for label in variants],
            "dispatch": dispatch}
    report(data, args)
    return 0


def report(data, args) -> None:
    """Print the tables (and --json, --plot) of one run."""
    print(f"host overhead, {data['device']}, tokens={data['tokens']}, hidden={data['hidden']}, "
          f"{'inputs require grad' if data['grad'] else 'no_grad'}, torch {data['torch']}, best of {data['rounds']} "
          f"interleaved rounds x {data['calls']} calls (us of CPU time per call)")
    print("| program | block(x, res) | program only | by hand | added by opfuse | of which the guard |")
    print("|---|---|---|---|---|---|")
    for row in data["rows"]:
        print(f"| {row['path']} ({row['modules']} modules) | {row['block']:.1f} | {row['program']:.1f} | "
              f"{row['hand']:.1f} | {row['block'] - row['hand']:+.1f} | {row['block'] - row['program']:+.1f} |")
    print()
    print("| fused op (implementation) | module call | implementation called directly | dispatch |")
    print("|---|---|---|---|")
    for case in data["dispatch"]:
        print(f"| {case['op']} | {case['module']:.1f} | {case['impl']:.1f} | {case['module'] - case['impl']:+.1f} |")
    worst = max(row["block"] - row["hand"] for row in data["rows"])
    print(f"\nadded per call by opfuse (worst program): {worst:+.1f} us (target <= 10 us: "
          f"{'met' if worst <= 10 else 'NOT met'})")
    bars = {}
    for row in data["rows"]:
        bars.update({f"{row['path']}: block(x, res)": row["block"], f"{row['path']}: by hand": row["hand"]})
    common.finish(args, data, bars=bars, ylabel="us of CPU time per call (host)",
                  title=f"host cost of one call, {data['device']}, tokens={data['tokens']}")


if __name__ == "__main__":
    sys.exit(main())
