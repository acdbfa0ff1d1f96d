"""A differential fuzzer of the torch.compile front end (issue 29): random small tensor-parallel
blocks written in plain PyTorch, each compiled with ``opfuse.optimize(m, options={"inductor":
False})`` on one gloo rank, run next to the same model eagerly.

A case draws: the dtype; biased projections and where the row-parallel bias goes (in the GEMM,
or added after the all-reduce); the activation; the residual add's operand order; the norm in each
of the forms models write it (Hugging Face, gpt-fast, ``nn.RMSNorm``, ``F.rms_norm``, hand-written
with the weight applied before the cast back, ``nn.LayerNorm``, ``F.layer_norm``) or none (the
graph ends with the all-reduce and the add, as a graph per block does); a graph break between the
all-reduce and the add; a float32 residual stream with half-precision activations; one or two
layers; one sequence length or three (automatic dynamic shapes); inference or training.

Every case must

* compile and run (never an internal error),
* equal eager (outputs; gradients of the inputs and every parameter when training),
* fuse what the rules are there to fuse (each all-reduce with its add and norm, or with its add
  when no norm follows in the graph), or say why in ``explain()``: every forward all-reduce that no
  rule fused with a neighbour has a near-miss line naming it, in the plain (non-FP8) rules' terms.

Seeds are fixed and the number of cases bounded (``OPFUSE_FUZZ_CASES`` runs more locally); a
failure prints the case, which ``make_case(seed)`` rebuilds.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import opfuse

EAGER = {"inductor": False}
H = 16
CASES = int(os.environ.get("OPFUSE_FUZZ_CASES", "40"))
NORMS = ("hf", "gpt-fast", "nn.RMSNorm", "F.rms_norm", "weight-first", "nn.LayerNorm", "F.layer_norm", "none")
LAYER_NORMS = ("nn.LayerNorm", "F.layer_norm")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    dtype: torch.dtype
    layers: int
    up_bias: bool
    down_bias: str          # "none" | "gemm" (in the row-parallel GEMM) | "after" (after the all-reduce)
    act: str                # "gelu" | "gelu_tanh" | "silu"
    order: str              # "h + y" | "y + h" (residual + update, or update + residual)
    norm: str               # one of NORMS
    graph_break: str        # "none" | "print" | "graph_break" (in the first layer, all-reduce -> add)
    residual32: bool        # a float32 residual stream with half-precision activations
    seqs: tuple[int, ...]   # one length, or three (automatic dynamic shapes)
    train: bool


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    return Case(
        seed=seed, dtype=dtype, layers=rng.choice([1, 2]), up_bias=rng.random() < 0.5,
        down_bias=rng.choice(["none", "gemm", "after"]), act=rng.choice(["gelu", "gelu_tanh", "silu"]),
        order=rng.choice(["h + y", "y + h"]), norm=NORMS[seed % len(NORMS)],
        graph_break=rng.choices(["none", "print", "graph_break"], [4, 1, 1])[0],
        residual32=dtype == torch.bfloat16 and rng.random() < 0.25,
        seqs=rng.choices([(5,), (5, 7, 9)], [2, 1])[0], train=rng.random() < 0.5,
    )


# Norms in the forms models write them ---------------------------------------------------------------


class HFNorm(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H, dtype=dtype))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class GPTFastNorm(HFNorm):
    def forward(self, x):
        out = x.float()
        out = out * torch.rsqrt(torch.mean(out * out, dim=-1, keepdim=True) + 1e-5)
        return out.type_as(x) * self.weight


class WeightFirstNorm(HFNorm):
    def forward(self, x):
        dtype = x.dtype
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * self.weight.float()).to(dtype)


class FunctionalNorm(nn.Module):
    def __init__(self, form, dtype):
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.ones(H, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(H, dtype=dtype)) if form == "F.layer_norm" else None

    def forward(self, x):
        if self.form == "F.rms_norm":
            return F.rms_norm(x, (H,), self.weight, 1e-6)
        return F.layer_norm(x, (H,), self.weight, self.bias, 1e-5)


def make_norm(form: str, dtype: torch.dtype) -> nn.Module | None:
    if form == "none":
        return None
    if form in ("F.rms_norm", "F.layer_norm"):
        return FunctionalNorm(form, dtype)
    if form == "nn.RMSNorm":
        return nn.RMSNorm(H, eps=1e-6, dtype=dtype)
    if form == "nn.LayerNorm":
        return nn.LayerNorm(H, dtype=dtype)
    return {"hf": HFNorm, "gpt-fast": GPTFastNorm, "weight-first": WeightFirstNorm}[form](dtype)


# The model ----------------------------------------------------------------------------------------------


class Layer(nn.Module):
    """A column-parallel projection, an activation, a row-parallel projection, its all-reduce,
    the residual add, the norm: returns ``(norm(h), h)``."""

    def __init__(self, case: Case, group, first: bool):
        super().__init__()
        self.case, self.group, self.first = case, group, first
        # The activations' and the residual stream's dtypes (float64 in the reference copy).
        self.dtype, self.residual_dtype = case.dtype, torch.float32 if case.residual32 else case.dtype
        self.up = nn.Linear(H, 2 * H, bias=case.up_bias, dtype=case.dtype)
        self.down = nn.Linear(2 * H, H, bias=case.down_bias == "gemm", dtype=case.dtype)
        self.bias = nn.Parameter(torch.zeros(H, dtype=case.dtype)) if case.down_bias == "after" else None
        self.norm = make_norm(case.norm, torch.float32 if case.residual32 else case.dtype)

    def forward(self, x, residual):
        case = self.case
        act = {"gelu": F.gelu, "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[case.act]
        y = funcol.all_reduce(self.down(act(self.up(x.to(self.dtype)))), "sum", self.group)
        if self.bias is not None:
            y = y + self.bias
        if self.first and case.graph_break == "print":
            print("opfuse fuzz: a graph break")
        elif self.first and case.graph_break == "graph_break":
            torch._dynamo.graph_break()
        if case.residual32:
            y = y.to(self.residual_dtype)
        h = residual + y if case.order == "h + y" else y + residual
        return (self.norm(h) if self.norm is not None else h), h


class Model(nn.Module):
    def __init__(self, case: Case, group):
        super().__init__()
        self.layers = nn.ModuleList(Layer(case, group, i == 0) for i in range(case.layers))

    def forward(self, x, residual):
        for layer in self.layers:
            x, residual = layer(x, residual)
        return x, residual


def reference(case: Case, group) -> Model:
    """The case's model computing in float64 (where a norm's own code does not cast to float32)."""
    exact = build(case, group).double()
    for layer in exact.layers:
        layer.dtype = layer.residual_dtype = torch.float64
    return exact


def build(case: Case, group) -> Model:
    torch.manual_seed(case.seed)
    model = Model(case, group)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape)
            if param.dim() == 1:  # norm weights near 1, biases near 0
                value = (1 if name.endswith("norm.weight") else 0) + 0.1 * noise
            else:
                value = noise / param.shape[1] ** 0.5
            param.copy_(value.to(param.dtype))
    return model


# The checks ---------------------------------------------------------------------------------------------


#: One rounding of each dtype, relative to the values' scale.
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def assert_as_exact(case: Case, what: str, got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor):
    """The compiled result is at most twice as far from the float64 result as eager is, plus one
    rounding of the dtype (a fused op rounds once where eager rounds after every op: neither is
    the reference, the exact math is)."""
    exact = exact.double()
    scale = exact.abs().max().item() or 1.0
    got_error = (got.double() - exact).abs().max().item()
    eager_error = (eager.double() - exact).abs().max().item()
    assert got.shape == eager.shape and got.dtype == eager.dtype, f"{case}: {what}: {got.shape} {got.dtype}"
    assert got_error <= 2 * eager_error + ROUNDING[case.dtype] * scale, (
        f"{case}: {what}: compiled is {got_error:.3g} from the float64 result, eager {eager_error:.3g} "
        f"(scale {scale:.3g})")


def run_both(case: Case, model, compiled, group):
    exact_model = reference(case, group)
    for seq in case.seqs:
        gen = torch.Generator().manual_seed(seq)
        x = torch.randn(2, seq, H, generator=gen)
        residual = torch.randn(2, seq, H, generator=gen)
        inputs = [x.to(case.dtype).requires_grad_(case.train),
                  residual.to(torch.float32 if case.residual32 else case.dtype).requires_grad_(case.train)]
        exact_inputs = [t.detach().double().requires_grad_(case.train) for t in inputs]
        with torch.set_grad_enabled(case.train):
            got, want, exact = compiled(*inputs), model(*inputs), exact_model(*exact_inputs)
        for i, (a, b, c) in enumerate(zip(got, want, exact)):
            assert_as_exact(case, f"output {i} at length {seq}", a, b, c)
        if case.train:
            grads = [torch.randn(g.shape, generator=gen) for g in want]
            names = ["x", "residual"] + [n for n, _ in model.named_parameters()]
            leaves = inputs + list(model.parameters())
            got_grads = torch.autograd.grad(got, leaves, [g.to(t.dtype) for g, t in zip(grads, got)])
            want_grads = torch.autograd.grad(want, leaves, [g.to(t.dtype) for g, t in zip(grads, want)])
            exact_grads = torch.autograd.grad(exact, exact_inputs + list(exact_model.parameters()),
                                              [g.double() for g in grads])
            for name, a, b, c in zip(names, got_grads, want_grads, exact_grads):
                assert_as_exact(case, f"gradient of {name} at length {seq}", a, b, c)


def near_miss_lines(program) -> list[str]:
    body = program.explain().split("near misses:", 1)[1].split("pass notes:", 1)[0]
    return [line.strip() for line in body.splitlines() if line.strip() and line.strip() != "none"]


def forward_all_reduces(program) -> list[str]:
    gm = program.unfused_graph_module
    backward, names = set(), []
    for node in gm.graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or backward & set(node.all_input_nodes):
            backward.add(node)
        elif node.op == "call_module" and gm.get_submodule(node.target).kind == "AllReduce":
            names.append(node.name)
    return names


def check_fused_or_explained(case: Case, programs):
    """Every forward all-reduce fused with its add (its norm, its bias after the reduction) unless a
    graph break or a dtype cast stands between them, and then explained in those terms; no FP8
    rule cited."""
    norm_kind = "LayerNorm" if case.norm in LAYER_NORMS else "RMSNorm"
    wanted = {"AllReduce", "AddExtraInput"} | ({norm_kind} if case.norm != "none" else set()) | (
        {"Bias"} if case.down_bias == "after" else set())
    for program in programs:
        text = program.explain()
        lines = near_miss_lines(program)
        for line in lines:
            assert not line.split(" ")[0].endswith(("_quantize", "_fp8")), f"{case}: FP8 rule cited\n{text}"
        fused = {name: f for f in program.fusions for name in f.nodes}
        for name in forward_all_reduces(program):
            record = fused.get(name)
            about = [line for line in lines if f"{name} (AllReduce)" in line.split("; ", 1)[0]]
            if record is not None and wanted <= set(record.ops):
                continue  # the full fusion
            assert len(about) == 1, f"{case}: all-reduce {name} neither fully fused nor explained once\n{text}"
            reasons = (["casts it from bfloat16 to float32"] if case.residual32 else []) + (
                ["is an output of this graph"] if case.graph_break != "none" else [])
            assert reasons, f"{case}: all-reduce {name} should have fused with {sorted(wanted)}\n{text}"
            assert any(reason in about[0] for reason in reasons), f"{case}: {about[0]}"


@pytest.mark.parametrize("seed", range(CASES))
def test_compile_fuzz(world1, seed):
    case = make_case(seed)
    model = build(case, world1)
    compiled = opfuse.optimize(model, options=EAGER, **({"dynamic": None} if len(case.seqs) > 1 else {}))
    run_both(case, model, compiled, world1)
    programs = opfuse.programs(compiled)
    assert programs, f"{case}: nothing compiled"
    for program in programs:
        assert not any("symbolic" in note for _, note in program.notes), f"{case}: {program.explain()}"
    check_fused_or_explained(case, programs)
