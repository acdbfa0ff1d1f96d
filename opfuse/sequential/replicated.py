"""Replicated inputs must be the same tensor on every rank: a digest check (``config.check_replicated``).

A block's input laid out as *replicated* over a tensor-parallel group (the input of a
column-parallel layer, a full-width input of a row-parallel one, a residual added after an
all-reduce) is assumed equal on every rank of the group; nothing else could tell. Ranks that pass
different values (an unseeded ``torch.randn``, a data loader that is not shared by the group, a
dropout whose RNG is not synchronised) compute a result that is silently wrong. What is checked:

* ``"compile"`` (default): when a block compiles for an input signature, each rank adds a digest
  of its replicated inputs to the signature it already exchanges with its peers
  (:mod:`.agree`); a difference raises :class:`ReplicatedMismatchError` on every rank, naming
  the input and the ranks. A token-sharded (sequence-parallel) input that is bitwise the same on
  every rank draws a warning: each rank was probably given the whole sequence instead of its
  part (or a constant warm-up input). One digest per compile: no per-call cost, but calls after
  the first are not checked.
* ``"always"``: every call also exchanges the digests (``all_gather_object`` over each group: a
  host synchronisation per call, for debugging), and identical token shards raise.
* ``"off"``: no check (for programs whose replicated values legitimately differ in their last
  bits, e.g. computed with non-deterministic kernels on each rank).

The digest is bitwise (the values' bits summed per row and per column, then hashed): replicated
values computed by the same deterministic code on every rank are bitwise equal, and a check with a
tolerance would miss a single differing token. Inputs that only reach a reduction (an
``AllReduce`` of each rank's partial sum) and the inputs of a ``GroupedLinear`` (per rank by
design: expert and FSDP parallelism) are not checked.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist
from torch import fx

from ..config import env_name
from ..ops import group as groups

__all__ = ["ReplicatedMismatchError", "inputs_to_check", "digests", "compare", "check_call"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Ops whose inputs are per rank by design (the experts' tokens, an FSDP rank's batch).
_PER_RANK_CONSUMERS = ("BasicGroupedLinear", "GroupedLinear", "GroupedGemm", "GroupedGemmFp8")
#: Reductions over ranks: what they read is each rank's own partial sum.
_REDUCTIONS = ("AllReduce", "ReduceScatter")


class ReplicatedMismatchError(RuntimeError):
    """Ranks passed different values for a replicated input, or the same values for a
    token-sharded one (see the module docstring)."""


def _kind(gm: fx.GraphModule, node: fx.Node):
    return getattr(gm.get_submodule(node.target), "kind", None) if node.op == "call_module" else None


def _replicated(node) -> bool:
    sharding = node.meta.get("opfuse_sharding") if isinstance(node, fx.Node) else None
    return sharding is not None and sharding.replicated


def _must_be_replicated(gm: fx.GraphModule) -> set:
    """Placeholders whose values every rank must hold alike: those that reach, through local ops,
    a tensor-parallel GEMM's replicated input (``GradAllReduce``, ``SplitFeatures``) or an
    elementwise op that combines them with an all-reduced value (a residual added after the
    reduction). A value that only reaches a reduction (``AllReduce``, ``ReduceScatter``) is a
    per-rank partial sum, and a ``GroupedLinear``'s tokens are per rank by design."""
    reduced = set()  # values every rank holds alike because a reduction made them
    stack = []
    for node in gm.graph.nodes:
        kind = _kind(gm, node)
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if kind == "AllReduce":
            reduced.add(node)
        elif node.op in ("call_module", "call_function") and inputs and inputs[0] in reduced and _replicated(node):
            reduced.add(node)
        if kind in ("GradAllReduce", "SplitFeatures"):
            stack.append(inputs[0])
        elif kind not in _REDUCTIONS and inputs and inputs[0] in reduced:
            stack.extend(inputs[1:])  # e.g. the residual of AddExtraInput after an all-reduce
    found, seen = set(), set()
    while stack:
        node = stack.pop()
        if node in seen or not _replicated(node):
            continue
        seen.add(node)
        kind = _kind(gm, node)
        if node.op == "placeholder":
            found.add(node)
        elif kind not in _REDUCTIONS and kind not in _PER_RANK_CONSUMERS and node.op != "output":
            stack.extend(a for a in node.all_input_nodes)
    return found


def inputs_to_check(gm: fx.GraphModule) -> list[tuple[int, str, str]]:
    """``(input position, placeholder name, layout)`` of the inputs to check: the replicated ones
    every rank must hold alike (:func:`_must_be_replicated`), and token-sharded ones (checked for
    being *equal* under ``"always"``)."""
    required = _must_be_replicated(gm)
    found = []
    for position, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        sharding = node.meta.get("opfuse_sharding")
        if sharding is None or sharding.features or sharding.partial:
            continue
        if sharding.tokens:
            kinds = {_kind(gm, u) for u in node.users}
            if not kinds & set(_PER_RANK_CONSUMERS):
                found.append((position, node.name, "tokens"))
        elif node in required:
            found.append((position, node.name, "replicated"))
    return found


def _digest(tensor: torch.Tensor) -> dict:
    """Bitwise digest of ``tensor`` plus two numbers for messages."""
    x = tensor.detach()
    if x.numel() == 0:
        return {"hash": "empty", "shape": list(x.shape), "sum": 0.0, "absmax": 0.0}
    flat = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    ints = flat.contiguous().view(_BITS[x.element_size()])
    # Integer sums are exact and associative: equal bits give equal sums on any device; a
    # differing element changes its row's and its column's sum.
    sums = torch.cat([ints.sum(1, dtype=torch.int64), ints.sum(0, dtype=torch.int64)])
    stats = torch.stack([x.double().sum(), x.double().abs().max()]).cpu().tolist()
    data = sums.cpu().numpy().tobytes() + f"{x.dtype}{list(x.shape)}".encode()
    return {"hash": hashlib.sha256(data).hexdigest()[:24], "shape": list(x.shape), "sum": stats[0],
            "absmax": stats[1]}


def digests(checked, inputs) -> dict | None:
    """``{placeholder name: digest}`` of the checked inputs, or ``None`` where values cannot be
    read (fake or meta tensors, a CUDA graph being captured)."""
    tensors = [(name, inputs[position]) for position, name, _ in checked]
    if not tensors or any(not isinstance(t, torch.Tensor) or t.device.type == "meta" for _, t in tensors):
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    try:
        from torch._subclasses.fake_tensor import is_fake

        if any(is_fake(t) for _, t in tensors):
            return None
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        return {name: _digest(t) for name, t in tensors}
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass without a bit view: unchecked
        return None


def _describe(digest: dict) -> str:
    return f"shape {digest['shape']}, sum {digest['sum']:.6g}, max |x| {digest['absmax']:.6g}"


def compare(where: str, checked, payloads: list, members: list, me: int, every_call: bool) -> None:
    """Raise :class:`ReplicatedMismatchError` when the ranks' digests (``payloads[r]``: rank r's
    ``{name: digest}`` or ``None``) say a replicated input differs, or (``every_call``) a
    token-sharded one is the same on every rank."""
    if any(p is None for p in payloads) or len(payloads) < 2:
        return
    setting = f"{env_name('check_replicated')}=off / opfuse.config.check_replicated='off'"
    for _, name, layout in checked:
        mine = payloads[me].get(name)
        if mine is None:
            continue
        if layout == "replicated":
            others = [r for r, p in enumerate(payloads) if p.get(name, {}).get("hash") != mine["hash"]]
            if others:
                other = payloads[others[0]][name]
                raise ReplicatedMismatchError(
                    f"opfuse: {where}: input {name} is replicated in this block (every rank must pass the same "
                    f"tensor) but global ranks {[members[r] for r in others]} passed other values than global rank "
                    f"{members[me]} (global rank {members[me]}: {_describe(mine)}; global rank "
                    f"{members[others[0]]}: {_describe(other)}): pass the same tensor on every rank of the group "
                    f"(the same seed, or broadcast it); per-rank data must be sharded (sequence_parallel=True takes "
                    f"each rank's tokens). If the difference is rounding from non-deterministic kernels, {setting} "
                    f"turns this check off")
        elif mine["hash"] != "empty" and all(p.get(name, {}).get("hash") == mine["hash"] for p in payloads):
            tokens, world = mine["shape"][0], len(payloads)
            expected = (f"{tokens // world} tokens (x.chunk({world})[rank])" if tokens % world == 0
                        else f"1/{world} of them ({tokens} is not divisible by {world})")
            text = (f"opfuse: {where}: input {name} is token-sharded (sequence parallel: each rank passes its own "
                    f"part of the sequence) but every rank passed the same {tokens} tokens ({_describe(mine)}): if "
                    f"these are the whole sequence, each rank passes {expected}")
            if every_call:
                raise ReplicatedMismatchError(f"{text}. Identical shards on purpose: opfuse.config.check_replicated="
                                              f"'compile' only warns, once per compile")
            # Identical shards can be legitimate (constant warm-up inputs), so the default warns.
            warnings.warn(f"{text} ({env_name('check_replicated')}=always makes this an error)", UserWarning,
                          stacklevel=2)


def check_call(checked, pgs, inputs) -> None:
    """``config.check_replicated == "always"``: exchange the digests of this call's ``checked``
    inputs over the block's groups ``pgs`` and :func:`compare` them (a collective and a host
    synchronisation per call)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # every rank captures the same calls: none exchanges anything
    mine = digests(checked, inputs)
    for pg in pgs:
        world = dist.get_world_size(pg)
        payloads = [None] * world
        dist.all_gather_object(payloads, mine, group=pg)
        where = f"process group {groups.group_name(pg)!r} (global ranks {dist.get_process_group_ranks(pg)}), a call"
        compare(where, checked, payloads, dist.get_process_group_ranks(pg), dist.get_rank(pg), every_call=True)
