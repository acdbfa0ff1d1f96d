"""Mixture-of-experts layers written as Hugging Face writes them, as grouped GEMMs.

Hugging Face's Mixtral / Qwen2-MoE / OLMoE blocks route each token to its top-k experts and then
loop over the experts::

    for e in range(num_experts):                      # or: for e in experts that got tokens
        idx, top_x = torch.where(expert_mask[e])      # data-dependent: which tokens chose e
        y = experts[e](x[top_x]) * routing_weights[top_x, idx, None]
        out.index_add_(0, top_x, y)

The token count of each expert is known only on the device, so a compiled model either syncs
with the host and graph-breaks at every expert, or traces unbacked sizes and still runs one small
GEMM per expert. No graph-level pattern can turn that loop into one GEMM: by the time Dynamo has
a graph, the loop is gone (unrolled with data-dependent shapes, or broken into per-expert
fragments). What an expert does instead is rewrite the *module*, before Dynamo, into the
dropless-MoE formulation MegaBlocks and torchtitan use, which computes the same thing with static
shapes:

1. the router as written (``softmax`` in float32, ``topk``, the optional renormalisation);
2. the ``tokens * top_k`` (token, expert) pairs sorted by expert on the device (``argsort``),
   the group sizes counted on the device (``scatter_add``): no host sync, CUDA-graph capturable;
3. one grouped GEMM over every expert's gate and up projections (``[E, 2F, H]``, each expert's
   gate rows then up rows), the activation, one grouped GEMM over the down projections
   (``[E, H, F]``): ``opfuse::grouped_linear`` (its implementation chosen per shape; opfuse's
   backend re-chooses it in the compiled graph, and runs it in FP8 under ``fp8=``);
4. each row scaled by its routing weight and summed back into its token: a gather through the
   inverse of the sort and a float32 sum of the token's ``top_k`` rows, and the same gathers
   transposed in the backward (autograd's ``index_add`` / ``index_select`` pair scatters with
   atomics, which Inductor leaves to ATen for 16-bit types: far slower than a gather).

:func:`rewrite_moe_` recognises a block by structure (``gate``/``router`` linear with one output
per expert, ``experts`` holding ``E`` MLPs of ``w1/w3/w2`` or ``gate_proj/up_proj/down_proj``
without biases, ``top_k``/``num_experts_per_tok``; Qwen2-MoE's ``shared_expert`` and
``shared_expert_gate``), installs the grouped forward on that instance (class, parameters,
``state_dict`` keys, hooks unchanged) and keeps it only if it gives the original forward's outputs
on a probe input; otherwise the block is left as it was and ``explain()`` says why. The experts'
weights are stored back to back (each expert's ``nn.Parameter`` becomes a view of one buffer, as
for merged projections), so the stacked ``[E, N, K]`` weights are views, never copies.

Expert parallelism (an all-to-all moving tokens to the ranks owning their experts) is not
rewritten; tensor-parallel experts (each expert's projections sharded like an MLP's, the block's
output all-reduced after it) are, since each rank's grouped GEMMs run on its shards as its
per-expert GEMMs did.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..families.grouped_linear.op import GROUPED_LINEAR, GroupedGemm
from ..core import dispatch as implementations
from ..core.passes.select import forced_implementations
from ..machinery.implementation import choose, forced_for
from ..ops.base import TensorMeta
from ..ops.norm import compute_dtype
from ..ops.packing import join_rows
from .merge_projections import PackedParameters

__all__ = ["MoESpec", "describe_moe_block", "rewrite_moe_", "grouped_experts", "stacked_experts_router"]

_PROJECTIONS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """What the grouped forward of one block needs: the router's attribute, the experts'
    projection names (gate, up, down), ``top_k``, whether the top-k weights are renormalised,
    whether a gated shared expert is added, and sizes."""

    router: str
    names: tuple[str, str, str]
    top_k: int
    normalize: bool
    shared: bool
    experts: int
    hidden: int
    ffn: int


def _linear(module, name) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def stacked_experts_router(block: nn.Module) -> nn.Module | None:
    """The router of a block whose experts are already stacked, else ``None``: ``experts`` is one
    module holding ``[E, N, K]`` weights (transformers 5's grouped experts, torchtitan's) and
    ``gate`` / ``router`` has a ``[E, hidden]`` weight. Such a block needs no rewrite: its
    ``torch._grouped_mm`` (or transformers' ``grouped_mm_fallback``) calls are recognised in the graph
    (:mod:`opfuse.families.grouped_linear.recognizers`)."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module) or isinstance(experts, (nn.ModuleList, nn.Sequential)):
        return None
    stacked = [p for p in experts.parameters(recurse=False) if p.dim() == 3]
    if not stacked:
        return None
    count = stacked[0].shape[0]
    for name in ("gate", "router"):
        router = getattr(block, name, None)
        weight = getattr(router, "weight", None)
        if isinstance(router, nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                and weight.shape[0] == count:
            return router
    return None


def describe_moe_block(block: nn.Module) -> MoESpec | str | None:
    """The block's :class:`MoESpec`; a reason when it looks like an MoE block that cannot be
    rewritten; ``None`` when it is not an MoE block."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, (nn.ModuleList, nn.Sequential)) or len(experts) < 2:
        return None
    router = next((n for n in ("gate", "router") if _linear(block, n) is not None), None)
    if router is None:
        return None
    count = len(experts)
    gate = _linear(block, router)
    if gate.out_features != count:
        return f"its router {router} has {gate.out_features} outputs for {count} experts (expert parallelism?)"
    names = next((p for p in _PROJECTIONS if all(_linear(experts[0], n) is not None for n in p)), None)
    if names is None:
        return f"its experts ({type(experts[0]).__name__}) are not gate/up/down MLPs (w1/w3/w2 or gate_proj/up_proj/down_proj)"
    first = [_linear(experts[0], n) for n in names]
    for index, expert in enumerate(experts):
        layers = [_linear(expert, n) for n in names]
        if any(layer is None for layer in layers):
            return f"expert {index} lacks one of {names}"
        if any(layer.bias is not None for layer in layers):
            return "its expert projections have biases"
        if [tuple(layer.weight.shape) for layer in layers] != [tuple(layer.weight.shape) for layer in first]:
            return f"expert {index} has other shapes than expert 0"
        if any(hasattr(layer.weight, "_spec") for layer in layers):
            return "its expert weights are DTensors (rewritten only for plain or hand-sharded tensors)"
        if not callable(getattr(expert, "act_fn", None)):
            return f"expert {index} has no act_fn"
    top_k = getattr(block, "top_k", getattr(block, "num_experts_per_tok", None))
    if not isinstance(top_k, int) or not 1 <= top_k <= count:
        return "it has no top_k / num_experts_per_tok in 1..experts"
    if float(getattr(block, "jitter_noise", 0) or 0) > 0:
        return "router jitter noise (jitter_noise > 0) is not reproduced"
    gate_w, up_w, down_w = (layer.weight for layer in first)
    hidden, ffn = gate_w.shape[1], gate_w.shape[0]
    if up_w.shape != gate_w.shape or tuple(down_w.shape) != (hidden, ffn):
        return "its experts' gate/up/down shapes do not chain"
    shared = _linear(block, "shared_expert_gate") is not None and isinstance(getattr(block, "shared_expert", None),
                                                                            nn.Module)
    normalize = bool(getattr(block, "norm_topk_prob", True))
    return MoESpec(router, names, top_k, normalize, shared, count, hidden, ffn)


# The grouped forward ----------------------------------------------------------------------------------


def _grouped_spec(x_shape, dtype, device, groups: int, n: int, k: int, requires_grad: bool):
    weight = nn.Parameter(torch.empty((groups, n, k), dtype=dtype, device="meta"), requires_grad=requires_grad)
    module = GroupedGemm(weight=weight, bias=None, num_groups=groups, in_features=k, out_features=n)
    x = TensorMeta(tuple(x_shape), dtype, torch.device(device), requires_grad)
    sizes = TensorMeta((groups,), torch.int64, torch.device(device))
    with torch.set_grad_enabled(requires_grad):
        return module.call_spec([x, sizes])


_IMPLS: dict[str, str] = {}


@torch.compiler.assume_constant_result
def _grouped_impl(key: str) -> str:
    """The ``grouped_linear`` implementation for ``key`` = ``"device|dtype|T|G|N|K|grad"`` (a
    string, so that Dynamo evaluates this once while tracing and keeps the answer as a constant)."""
    found = _IMPLS.get(key)
    if found is None:
        device, dtype, tokens, groups, n, k, grad = key.split("|")
        spec = _grouped_spec((int(tokens), int(k)), getattr(torch, dtype), device, int(groups), int(n), int(k),
                             grad == "1")
        impls = implementations.for_op("grouped_linear", spec)
        found = _IMPLS[key] = choose(spec, impls, forced_for("grouped_linear", impls, forced_implementations())).name
    return found


def _grouped(x: torch.Tensor, sizes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    groups, n, k = weight.shape
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    key = f"{x.device}|{str(x.dtype).removeprefix('torch.')}|{x.shape[0]}|{groups}|{n}|{k}|{int(grad)}"
    return GROUPED_LINEAR(x, sizes, weight, None, "", _grouped_impl(key))


class _SpreadRows(torch.autograd.Function):
    """``x [T, H] -> x[token] [T * k, H]``: each token's row once per (token, expert) pair, in expert
    order. Backward: each token's ``k`` row gradients summed through the inverse permutation (a
    gather and a float32 sum, rounded once), where autograd's own ``index_add`` would scatter with
    atomics, which Inductor leaves to ATen's kernel for 16-bit types (an order of magnitude slower
    than a gather: docs/PERF_NOTES.md, "Results, session 19")."""

    @staticmethod
    def forward(ctx, x, token, inverse, top_k: int):
        ctx.save_for_backward(token, inverse)
        ctx.top_k = top_k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        token, inverse = ctx.saved_tensors
        return _CollectRows.apply(grad, token, inverse, ctx.top_k), None, None, None


class _CollectRows(torch.autograd.Function):
    """``y [T * k, H]`` (rows in expert order) ``-> out [T, H]``, ``out[t] = sum_j y[inverse[t * k + j]]``:
    the transpose of :class:`_SpreadRows` (float32 sum of each token's ``k`` rows, rounded once;
    deterministic, where ``index_add`` adds in arrival order and rounds at every add). Backward:
    ``grad[token]``, a gather."""

    @staticmethod
    def forward(ctx, y, token, inverse, top_k: int):
        ctx.save_for_backward(token, inverse)
        ctx.top_k = top_k
        rows = y.index_select(0, inverse).view(-1, top_k, y.shape[-1])
        return rows.sum(1, dtype=compute_dtype(y.dtype)).to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        token, inverse = ctx.saved_tensors
        return _SpreadRows.apply(grad, token, inverse, ctx.top_k), None, None, None


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, act) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{selected[t, j]}(x[t])`` for every token ``t`` with grouped GEMMs:
    ``gate_up`` ``[E, 2F, H]`` (each expert's gate rows, then its up rows), ``down`` ``[E, H, F]``,
    ``act`` the gate's activation. Static shapes; the group sizes stay on the device. Tokens move
    to and from expert order by gathers both ways, forward and backward (no atomic scatter)."""
    tokens, top_k = selected.shape
    groups, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    flat = selected.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = torch.div(order, top_k, rounding_mode="floor")
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    sizes = torch.zeros(groups, dtype=torch.int64, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
    rows = _SpreadRows.apply(x, token, inverse, top_k)
    hidden = _grouped(rows, sizes, gate_up)
    hidden = act(hidden[:, :ffn]) * hidden[:, ffn:]
    out = _grouped(hidden, sizes, down)
    out = out * _SpreadRows.apply(weights.reshape(-1, 1), order, inverse, 1)  # each pair's weight, in expert order
    return _CollectRows.apply(out, token, inverse, top_k)


def _stacked(block) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' ``[E, 2F, H]`` gate+up and ``[E, H, F]`` down weights: views of the packed
    parameters (a copy only if they were moved apart; traced by Dynamo as a concatenation that
    opfuse's backend reads as a view)."""
    spec = block._opfuse_moe
    gate, up, down = spec.names
    experts = block.experts
    gate_up = join_rows([getattr(e, n).weight for e in experts for n in (gate, up)])
    downs = join_rows([getattr(e, down).weight for e in experts])
    return (gate_up.view(spec.experts, 2 * spec.ffn, spec.hidden), downs.view(spec.experts, spec.hidden, spec.ffn))


def _grouped_forward(self, hidden_states):
    spec = self._opfuse_moe
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    logits = getattr(self, spec.router)(x)
    probs = F.softmax(logits, dim=1, dtype=torch.float)
    weights, selected = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    gate_up, down = _stacked(self)
    out = grouped_experts(x, weights, selected, gate_up, down, self.experts[0].act_fn)
    if spec.shared:
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    out = out.reshape(shape)
    return (out, logits) if self._opfuse_moe_returns_logits else out


# Rewriting ------------------------------------------------------------------------------------------------


def _flatten(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _probe(block: nn.Module, spec: MoESpec) -> tuple[bool, str]:
    """Run the original forward and the grouped one on a probe input; ``(returns logits, "")``
    when they agree, else ``(False, reason)``."""
    weight = getattr(block, spec.router).weight
    generator = torch.Generator(device=weight.device).manual_seed(1234)
    tokens = max(4 * spec.experts, 16)
    x = torch.randn((1, tokens, spec.hidden), generator=generator, device=weight.device, dtype=torch.float32)
    x = x.to(weight.dtype)
    training = block.training
    block.eval()
    try:
        with torch.no_grad():
            want = _flatten(type(block).forward(block, x))
            block._opfuse_moe_returns_logits = len(want) == 2
            got = _flatten(_grouped_forward(block, x))
    except Exception as error:  # noqa: BLE001 - any failure means: leave the block alone
        return False, f"the grouped forward failed on a probe input ({type(error).__name__}: {error})"
    finally:
        block.train(training)
    if len(want) not in (1, 2) or len(got) != len(want):
        return False, f"its forward returns {len(want)} values (expected the output, and optionally router logits)"
    tolerance = 1e-4 if weight.dtype == torch.float32 else 3e-2
    for a, b in zip(got, want):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False, "its forward returns values of other shapes or dtypes than the grouped forward"
        scale = b.float().abs().max().clamp_min(1e-6)
        error = ((a.float() - b.float()).abs().max() / scale).item()
        if not error <= tolerance:
            return False, (f"its outputs differ from the grouped forward's on a probe input (relative error {error:.2e}): "
                           f"a routing or expert computation this rewrite does not reproduce")
    return True, ""


def rewrite_moe_(model: nn.Module, packed: PackedParameters) -> list[str]:
    """Rewrite every recognised MoE block of ``model`` (module docstring); its expert weights are
    added to ``packed`` and stored back to back. Returns one note per MoE-like block (rewritten,
    or why not)."""
    notes = []
    for name, block in model.named_modules():
        spec = describe_moe_block(block)
        if spec is None:
            continue
        label = f"{name or '(model)'} ({type(block).__name__})"
        if isinstance(spec, str):
            notes.append(f"{label} not rewritten: {spec}")
            continue
        forward = block.__dict__.get("forward")
        again = getattr(forward, "__func__", None) is _grouped_forward
        if forward is not None and not again:
            notes.append(f"{label} not rewritten: its forward was replaced on the instance already")
            continue
        if not again:
            block._opfuse_moe = spec
            ok, reason = _probe(block, spec)
            if not ok:
                del block._opfuse_moe
                notes.append(f"{label} not rewritten: {reason}")
                continue
        spec = block._opfuse_moe
        gate, up, down = spec.names
        packed.add([(getattr(e, n), "weight") for e in block.experts for n in (gate, up)], f"{name}.experts gate+up")
        packed.add([(getattr(e, down), "weight") for e in block.experts], f"{name}.experts down")
        block.forward = types.MethodType(_grouped_forward, block)
        shared = ", plus the gated shared expert" if spec.shared else ""
        notes.append(f"{label} rewritten: {spec.experts} experts, top-{spec.top_k}, per-expert loop -> sorted tokens "
                     f"and two grouped GEMMs (gate+up [{spec.experts}, {2 * spec.ffn}, {spec.hidden}], down "
                     f"[{spec.experts}, {spec.hidden}, {spec.ffn}]) with group sizes on the device{shared}")
    packed.ensure()
    return notes
