"""The torch.compile backend on 2 gloo ranks: examples/llama_tp.py, tensor-parallel with
torch.distributed calls and with DTensor, compiled with opfuse, against the same model run eagerly
(outputs and every gradient), and the fusions it must find: one all-reduce + residual add +
RMSNorm per row-parallel projection (the MLP's joins the next layer's norm), all-reduces of the
backward's input gradients through the fused all-reduce; with DTensor sequence parallelism (batch 1
and 2), each row projection with its reduce-scatter, each all-gather with its largest GEMM and each
residual add with the norm after it.

One spawn per world runs every case (process start-up and compilation dominate on 2 CPU cores;
tests/dist/shared_spawn.py); the fused graphs run eagerly (``options={"inductor": False}``) except
in one case, compiled by Inductor.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

F32 = 1e-5
BF16 = 2e-2


def rules(programs, phase):
    return [f.rule for p in programs for f in p.fusions_in(phase)]


def check_case(rank, world, tp, train, inductor, dtype, tolerance, batch=2, cfg=None):
    import llama_tp

    cfg = cfg or llama_tp.Config()
    errors, programs = llama_tp.run_check(rank, world, tp, train, inductor, cfg=cfg, dtype=dtype, batch=batch,
                                          verbose=False)
    label = f"{tp} train={train} inductor={inductor} {dtype}"
    bad = {k: v for k, v in errors.items() if not v <= tolerance}
    assert not bad, f"{label}: compiled differs from eager beyond {tolerance}: {bad}"
    assert len(programs) == 1, f"{label}: {programs}"
    (program,) = programs
    assert program.kind == ("training" if train else "inference")
    forward = rules(programs, "forward")
    row_parallel = len(llama_tp.ROW_PARALLEL) * cfg.layers
    if tp == "dtensor-sp":
        # Each row projection with its reduce-scatter; each residual add with the next norm.
        # batch > 1: the sequences' split + cat before each reduce-scatter is taken by its own pass.
        scatter = "linear_reduce_scatter" if batch == 1 else "linear_reduce_scatter_batch"
        assert forward.count(scatter) == row_parallel, f"{label}: {program.explain()}"
        assert forward.count("add_rmsnorm") == row_parallel + 1, f"{label}: {program.explain()}"
        if train:  # each gather (attention, MLP, output head) with its largest GEMM, kept for the backward
            assert forward.count("all_gather_keep") == 2 * cfg.layers + 1, f"{label}: {program.explain()}"
            # The backward's gather of each row projection's output gradient (and the final
            # norm's), which no GEMM is recognised beside: taken alone, over peer memory on GPUs.
            backward = rules(programs, "backward")
            assert backward.count("gradient_all_gather") == row_parallel + 1, f"{label}: {program.explain()}"
            assert "gradient_all_gather" not in forward, f"{label}: {program.explain()}"
        return
    assert forward.count("allreduce_add_rmsnorm") == row_parallel, f"{label}: {program.explain()}"
    assert "allreduce" not in forward, f"{label}: an all-reduce fused alone in forward: {program.explain()}"
    if train:
        backward = rules(programs, "backward")
        # Input gradients of the column-parallel projections: one all-reduce per projection group
        # (dist) or per projection (DTensor).
        per_layer = 2 if tp == "dist" else len(llama_tp.COLUMN_PARALLEL)
        assert backward.count("allreduce") == per_layer * cfg.layers, f"{label}: {program.explain()}"
    covered = {name for f in program.fusions if f.rule == "allreduce_add_rmsnorm" for name in f.nodes}
    norms = [n for n in covered if n.startswith("rms_norm")]
    assert len(norms) == row_parallel  # each reduction took a different norm, the final one included


def autocast_case(rank, world):
    """Sequence parallelism with float32 parameters under ``torch.autocast`` (bf16): the weights are
    cast in the graph, and each row projection still fuses with its reduce-scatter; outputs and
    float32 gradients are eager autocast's."""
    import copy

    import llama_tp

    import opfuse

    cfg = llama_tp.Config()
    eager = llama_tp.build("dtensor-sp", rank, world, cfg, torch.float32, "cpu")
    model = copy.deepcopy(eager)
    compiled = opfuse.optimize(model, options={"inductor": False})
    tokens = torch.randint(0, cfg.vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = eager(tokens), compiled(tokens)
    assert llama_tp.relative_error(got, want) <= BF16
    want.float().square().sum().backward()
    got.float().square().sum().backward()
    mine, ref = llama_tp.local_grads(model), llama_tp.local_grads(eager)
    for name in ref:
        assert mine[name].dtype == torch.float32, name
        assert llama_tp.relative_error(mine[name], ref[name]) <= BF16, name
    (program,) = opfuse.programs(compiled)
    row_parallel = len(llama_tp.ROW_PARALLEL) * cfg.layers
    assert rules([program], "forward").count("linear_reduce_scatter") == row_parallel, program.explain()


def cases(rank, world):
    check_case(rank, world, "dist", True, False, torch.float32, F32)
    check_case(rank, world, "dtensor", True, False, torch.float32, F32)
    check_case(rank, world, "dtensor-sp", True, False, torch.float32, F32, batch=1)
    check_case(rank, world, "dtensor-sp", True, False, torch.float32, F32, batch=2)
    check_case(rank, world, "dtensor", False, False, torch.bfloat16, BF16)
    check_case(rank, world, "dist", True, True, torch.float32, F32)
    autocast_case(rank, world)


def test_llama_example_fuses_and_matches_eager(shared_spawn):
    shared_spawn.run(cases, 2, timeout=900)


def cases_world4(rank, world):
    import llama_tp

    cfg = llama_tp.Config(heads=4, kv_heads=4)  # one key/value head per rank
    check_case(rank, world, "dist", True, False, torch.float32, F32, cfg=cfg)
    check_case(rank, world, "dtensor", True, False, torch.float32, F32, cfg=cfg)


def test_llama_example_at_world_4(shared_spawn):
    shared_spawn.run(cases_world4, 4, timeout=900)


def hf_case(rank, world):
    import hf_llama_tp

    errors, programs = hf_llama_tp.run_check(rank, world, train=True, inductor=False, verbose=False)
    bad = {k: v for k, v in errors.items() if not v <= F32}
    assert not bad, f"transformers Llama: compiled differs from eager: {bad}"
    forward = rules(programs, "forward")
    assert forward.count("allreduce_add_rmsnorm") == 2 * 2, [p.explain() for p in programs]


def test_transformers_llama_with_its_tp_plan(shared_spawn):
    pytest.importorskip("transformers")
    shared_spawn.run(hf_case, 2, timeout=900)


#: The tests' cases in one spawn per world (tests/dist/shared_spawn.py); a case that does not finish
#: there runs alone in its test.
SHARED_CASES = [(cases, 2, ()), (cases_world4, 4, ()), (hf_case, 2, ())]
