"""FP8 and MoE through the torch.compile backend on 2 gloo ranks.

* examples/llama_tp.py under ``opfuse.optimize(model, fp8=recipe)``, tensor-parallel with
  ``torch.distributed`` calls, with DTensor, and with DTensor sequence parallelism, against the
  same model sharded by hand and run eagerly with every ``nn.Linear`` in the recipe's float32
  emulation (outputs and every gradient): each row-parallel projection's all-reduce fuses with the
  residual add, the next norm and the quantization of the next GEMMs' input; with sequence
  parallelism each row projection's FP8 GEMM fuses with its reduce-scatter, and each norm quantizes
  the activation that the next all-gather then moves as FP8; the same with the norms + quantize
  written as aten ops (``opfuse.config.fp8_aten``), their amax all-reduced in the graph.
* Mixtral- and Qwen2-MoE-style blocks (examples/hf_moe.py) with tensor-parallel experts: the
  rewritten blocks against Hugging Face's loop run eagerly, and the all-reduce after each MoE
  block fused with the residual add and the next norm.

One spawn runs every case; graphs run without Inductor's code generation.
"""

import copy
import os
import sys

import torch

from .harness import run

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

TIGHT = 1e-5


def _emulated(model, recipe, keep):
    from opfuse import fp8

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and keep(name):
            module.forward = (lambda layer: lambda x: fp8.fp8_linear(x, layer.weight, layer.bias, recipe))(module)
    return model


def llama_case(rank, world, tp, recipe, seq=8, fp8_aten=None):
    import opfuse

    if fp8_aten is not None:
        with opfuse.config.override(fp8_aten=fp8_aten):
            return llama_case(rank, world, tp, recipe, seq)
    import llama_tp

    # Every case compiles the same forward code: past Dynamo's recompile limit a frame would run
    # eagerly (no FP8 at all), so each starts from an empty cache.
    torch._dynamo.reset()
    cfg = llama_tp.Config(kv_heads=max(2, world))  # world 4: one key/value head per rank
    # Sequence parallelism shards the output head over the vocabulary (its weight scale then
    # differs from the hand-sharded model's): compared in high precision there.
    keep = (lambda name: name != "output") if tp == "dtensor-sp" else (lambda name: True)
    reference = _emulated(llama_tp.build("dist", rank, world, cfg), recipe, keep)
    model = llama_tp.build(tp, rank, world, cfg)
    compiled = opfuse.optimize(model, fp8=recipe, fp8_filter=lambda fqn, module: keep(fqn),
                               options={"inductor": False})
    batch = 1 if tp == "dtensor-sp" else 2
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    want, got = reference(tokens), compiled(tokens)
    label = f"{tp} {recipe.describe()}, {seq} tokens, fp8_aten={opfuse.config.fp8_aten}"
    assert llama_tp.relative_error(got, want) <= TIGHT, f"{label}: {llama_tp.relative_error(got, want):.3g}"
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    want.backward(grad)
    got.backward(grad)
    mine, ref = llama_tp.local_grads(model), llama_tp.local_grads(reference)
    for name in ref:
        if mine[name].shape != ref[name].shape or (tp == "dtensor-sp" and "norm" in name):
            continue  # sharded differently (SP: partial sums of replicated norm weights)
        assert llama_tp.relative_error(mine[name], ref[name]) <= TIGHT, f"{label}: grad {name}"
    (program,) = opfuse.programs(compiled)
    forward = [f.rule for f in program.fusions_in("forward")]
    row_parallel = len(llama_tp.ROW_PARALLEL) * cfg.layers
    if tp == "dtensor-sp":
        assert forward.count("linear_reduce_scatter_fp8") == row_parallel, program.explain()
        assert forward.count("fp8_linear") == 5 * cfg.layers, program.explain()
        # q/k/v and gate/up read their all-gather through a reshape ([1, S, H] -> [S, H]): the
        # quantization still moves above the gather (FP8 bytes gathered) and into the norm
        assert forward.count("add_rmsnorm_quantize") == 2 * cfg.layers, program.explain()
        assert "quantize" not in forward, program.explain()
        # The backward's gradient gathers stay in high precision (the quantization of the gathered
        # gradient reads them): taken alone, never as FP8 bytes.
        backward = [f.rule for f in program.fusions_in("backward")]
        assert backward.count("gradient_all_gather") == row_parallel + 1, program.explain()
    else:
        # Every row projection's all-reduce + add + norm emits the next GEMMs' FP8 input (the
        # final norm's feeds the output head).
        assert forward.count("allreduce_add_rmsnorm_quantize") == row_parallel, program.explain()
        assert forward.count("fp8_linear") == 7 * cfg.layers + 1, program.explain()
    assert "projection GEMM(s) in FP8, forward and backward" in program.explain()
    if opfuse.config.fp8_aten == "always":
        # The norms that quantize without an all-reduce in them (sequence parallelism: each one's
        # amax all-reduced for the FP8 gather after it) are aten ops; the others keep their kernels.
        written = 2 * cfg.layers if tp == "dtensor-sp" else 0
        assert (f"{written} FP8 producer(s) written as aten ops" in program.explain()) == bool(written), \
            program.explain()
        # So are the FP8 GEMM + reduce-scatters where their GEMM is a torch._scaled_mm one.
        from opfuse.torch_compile import fp8_aten

        scatters = row_parallel if tp == "dtensor-sp" and not recipe.rowwise and "reference" in \
            fp8_aten.IMPLEMENTATIONS else 0
        assert (f"{scatters} FP8 GEMM + reduce-scatter(s) written as aten ops" in program.explain()) == \
            bool(scatters), program.explain()
    if recipe.pow2_weight_scales and tp == "dist":  # the layers' same-shape weights: one cast call each
        assert "FP8 weight casts quantized in" in program.explain(), program.explain()


def moe_case(rank, world, block):
    import torch.distributed as dist

    import opfuse
    from hf_moe import MoEDecoder, shard_experts_

    torch.manual_seed(0)
    full = shard_experts_(MoEDecoder(block), rank, world)
    eager, model = copy.deepcopy(full), copy.deepcopy(full)
    eager.tp = model.tp = dist.group.WORLD
    compiled = opfuse.optimize(model, options={"inductor": False})
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, want = compiled(x), eager(xr)
    relative = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()  # noqa: E731
    assert relative(y, want) <= TIGHT, block.__name__
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    y.backward(grad)
    want.backward(grad)
    assert relative(x.grad, xr.grad) <= TIGHT
    for a, b in zip(model.parameters(), eager.parameters()):
        if b.grad is not None:  # experts no token chose have no gradient in Hugging Face's loop
            assert relative(a.grad, b.grad) <= TIGHT, block.__name__
    (program,) = opfuse.programs(compiled)
    found = [f.rule for f in program.fusions]
    assert found.count("allreduce_add_rmsnorm") == 2 and found.count("grouped_linear") == 4, program.explain()


def cases(rank, world):
    from opfuse import fp8
    from hf_moe import MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock

    llama_case(rank, world, "dist", fp8.TensorScaling())
    llama_case(rank, world, "dist", fp8.RowwiseScaling())
    llama_case(rank, world, "dtensor", fp8.TensorScaling())
    llama_case(rank, world, "dtensor-sp", fp8.TensorScaling())
    aten_cases(rank, world)
    moe_case(rank, world, MixtralSparseMoeBlock)
    moe_case(rank, world, Qwen2MoeSparseMoeBlock)


def aten_cases(rank, world):
    """The FP8 linears written as aten ops (the GPU's torch._scaled_mm path; the reference stands
    in here), fed by the all-reduce + add + norm + quantize payloads; under sequence parallelism
    the collective FP8 GEMMs' forwards stay custom ops and their backward GEMMs are aten ops (16
    tokens per rank: the FP8 weight gradient's multiple of 16)."""
    from opfuse import fp8
    from opfuse.torch_compile import fp8_aten

    saved = fp8_aten.IMPLEMENTATIONS
    fp8_aten.IMPLEMENTATIONS = {"reference"}
    try:
        llama_case(rank, world, "dist", fp8.TensorScaling())
        llama_case(rank, world, "dtensor-sp", fp8.TensorScaling(), seq=16 * world)
        # power-of-two weight scales: the one-read weight quantizer in the aten forward and backward
        # (the layers' same-shape weights cast in one call), and the collective FP8 GEMMs' forwards
        # (their implementations' weight operands)
        llama_case(rank, world, "dist", fp8.TensorScaling(pow2_weight_scales=True))
        if world == 2:
            llama_case(rank, world, "dtensor-sp", fp8.TensorScaling(pow2_weight_scales=True), seq=16 * world)
        # The norms + quantize as aten ops (opfuse.config.fp8_aten; what a GPU graph compiled
        # without CUDA graphs gets), their amax all-reduced as a functional collective in the graph.
        llama_case(rank, world, "dtensor-sp", fp8.TensorScaling(), seq=16 * world, fp8_aten="always")
        llama_case(rank, world, "dist", fp8.TensorScaling(), fp8_aten="always")
        if world == 2:
            llama_case(rank, world, "dtensor-sp", fp8.RowwiseScaling(), seq=16 * world, fp8_aten="always")
    finally:
        fp8_aten.IMPLEMENTATIONS = saved


def test_fp8_llama_and_tensor_parallel_moe_match_their_references():
    run(cases, 2, timeout=900)


def test_fp8_aten_path_at_world_4():
    run(aten_cases, 4, timeout=900)
