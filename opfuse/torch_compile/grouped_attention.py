"""Grouped-query attention at decode without repeated key/value heads.

Models with fewer key/value heads than query heads (GQA) written the usual ways, gpt-fast's
``k.repeat_interleave(groups, dim=1)`` and Hugging Face's ``repeat_kv`` (``expand`` + ``reshape``),
both reach the aten graph as ``view(clone(expand(unsqueeze(k, 2), [B, Hk, g, L, D])), [B, Hk*g, L, D])``:
every decode step copies the whole key/value cache ``g`` times before the attention reads it
(with a cache of L positions, 2 x g x L x Hk x D elements written and read again per layer).

For a single query position (decode) the repeat is not needed, and :func:`fold_grouped_queries`
removes it in one of two ways (``opfuse.config.grouped_query_attention``):

* ``decode_attention`` (opfuse's op, :mod:`opfuse.families.attention`; ``auto``, the default,
  wherever its Triton kernels take the call; setting ``decode_attention``: also its reference where
  forced), whose kernels split the cache's positions over the GPU and take the ``g`` query heads of
  a key/value head as ``g`` rows of one tile, so even one sequence fills the GPU;
* the *fold* (``auto`` where the kernels above do not run, e.g. on the CPU, with at least
  :data:`MIN_FOLDED_HEADS` (sequence, key/value head) pairs; ``fold``: everywhere): the ``g`` query
  heads that share a key/value head become ``g`` query positions of that head, ``q [B, Hk*g, 1, D]
  -> [B, Hk, g, D]`` (exact: each query attends to its own key/value head with the same mask),
  through the SDPA kernel the graph already calls; the output ``[B, Hk, g, D]`` is put back in head
  order (one copy of ``B x Hk*g x D`` elements). Those kernels run one block per (sequence,
  key/value head) streaming the whole cache.

Training graphs, causal masks, masks per head and more than one query position are left, each
with its reason in ``explain()``.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from ..config import config
from ..families.attention import op as attention_op
from ..machinery.aten import is_static_size
from ..machinery.aten import value as fake_value

aten = torch.ops.aten

__all__ = ["fold_grouped_queries", "MIN_FOLDED_HEADS"]

#: The attention ops SDPA lowers to, and the name of each one's mask argument (None: takes none).
_ATTENTION = {
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention.default: None,
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
}

#: Attention ops that take their mask at its full size ([B, H, Q, L]; broadcasts as stride 0).
_FULL_MASK = {aten._scaled_dot_product_efficient_attention.default}

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)

#: Fewest (batch x key/value heads) for the fold: the SDPA kernels give each (sequence, head) of
#: the folded call one block streaming the whole cache, so with few of them the GPU is mostly idle.
#: One H200, cache of 1024 positions, 8 groups: at 1 x 8 the folded cuDNN attention took 24.8 us
#: per layer against 21.7 for the repeat copies and the attention over them; at 8 x 8, 25.9
#: against 157 (docs/PERF_NOTES.model.md, session 23).
MIN_FOLDED_HEADS = 16


def _static(*shapes) -> bool:
    """Whether every size is a plain int: a pass after the guards were made may not compare sizes
    that vary between calls (that would add guards), so graphs with dynamic shapes are left."""
    return all(is_static_size(size) for shape in shapes for size in shape)


def _repeated_heads(node) -> tuple[fx.Node, int] | None:
    """``(source, groups)`` when ``node`` is the head repeat of a ``[B, Hk, L, D]`` source, else None."""
    if not isinstance(node, fx.Node) or node.target not in _VIEWS:
        return None
    clone = node.args[0]
    if not isinstance(clone, fx.Node) or clone.target != aten.clone.default:
        return None
    expand = clone.args[0]
    if not isinstance(expand, fx.Node) or expand.target != aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target != aten.unsqueeze.default or unsqueeze.args[1] != 2:
        return None
    source = unsqueeze.args[0]
    val, out = fake_value(source), fake_value(node)
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or val.dim() != 4 or out.dim() != 4:
        return None
    sizes = list(expand.args[1])
    if not _static(val.shape, out.shape, sizes):
        return None
    batch, heads, length, dim = val.shape
    if len(sizes) != 5 or sizes[:2] != [batch, heads] or sizes[3:] != [length, dim]:
        return None
    groups = sizes[2]
    if list(out.shape) != [batch, heads * groups, length, dim]:
        return None
    return source, groups


def _mask_source(mask):
    """``mask`` before the broadcasts SDPA adds over the heads and the query positions (an
    ``expand`` to ``[B, H, Q, L]`` of a mask with one head and one position), or ``mask``. (A mask
    broadcast over the heads before it reached the graph, stride 0, is sliced in :func:`_one_mask`.)"""
    while isinstance(mask, fx.Node) and mask.target == aten.expand.default:
        val = fake_value(mask.args[0])
        if not isinstance(val, torch.Tensor) or val.dim() != 4 or val.shape[1] != 1 or val.shape[2] != 1:
            break
        mask = mask.args[0]
    return mask


def _why_not(node: fx.Node, kwargs: dict, mask_name: str | None, groups: int) -> str | None:
    """Why attention ``node`` (kwargs normalised; key and value heads repeated ``groups`` times)
    cannot read them unrepeated; None when it can."""
    query = fake_value(kwargs["query"])
    if query is None or query.dim() != 4:
        return "the query is not [batch, heads, positions, dim]"
    mask = _mask_source(kwargs.get(mask_name)) if mask_name else None
    mask_val = fake_value(mask) if mask is not None else None
    if not _static(query.shape, mask_val.shape if isinstance(mask_val, torch.Tensor) else ()):
        return "sizes that vary between calls (dynamic shapes)"
    if query.shape[2] != 1:
        return f"{query.shape[2]} query positions (only decode, one position, reads them unrepeated)"
    batch, heads, _, dim = query.shape
    try:
        query.view(batch, heads // groups, groups, dim)
    except RuntimeError:
        return "the query's strides give no [batch, kv heads, groups, dim] view"
    if kwargs.get("is_causal"):
        return "a causal mask"
    if kwargs.get("dropout_p", 0.0):
        return "dropout"
    users = list(node.users)
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
        return "outputs besides the attention's result are used (a training graph)"
    if mask is not None:
        val = fake_value(mask)
        if val is None or val.dim() != 4 or (val.shape[1] != 1 and val.stride(1) != 0) or val.shape[2] != 1:
            shape = None if val is None else list(val.shape)
            return f"the mask has shape {shape} (one mask for every head is needed, [batch, 1, 1, keys])"
    return None


def _call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A new node computing ``target(*args, **kwargs)``, its fake value computed from its inputs'."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake = lambda a: fake_value(a) if isinstance(a, fx.Node) else a  # noqa: E731
    node.meta["val"] = target(*[fake(a) for a in args], **{k: fake(v) for k, v in kwargs.items()})
    return node


def _one_mask(graph: fx.Graph, mask: fx.Node | None) -> fx.Node | None:
    """``mask`` as ``[Bm, 1, 1, L]`` (a mask broadcast over the heads by stride 0 sliced to one head)."""
    if mask is not None and fake_value(mask).shape[1] != 1:  # every head's row is the same memory
        mask = _call(graph, aten.slice.Tensor, (mask, 1, 0, 1))
    return mask


def _replace_result(graph: fx.Graph, node: fx.Node, make) -> None:
    """Every ``getitem(node, 0)`` (the only outputs used: :func:`_why_not`) replaced by ``make()``'s node."""
    for user in list(node.users):
        with graph.inserting_before(user):
            result = make()
        user.replace_all_uses_with(result)
        graph.erase_node(user)
    graph.erase_node(node)


def _fold(graph: fx.Graph, node: fx.Node, kwargs: dict, mask_name: str | None, key: fx.Node, value: fx.Node,
          groups: int) -> None:
    query = kwargs["query"]
    batch, heads, _, dim = fake_value(query).shape
    kv_heads = heads // groups
    with graph.inserting_before(node):
        folded = dict(kwargs)
        folded["query"] = _call(graph, aten.view.default, (query, [batch, kv_heads, groups, dim]))
        folded["key"], folded["value"] = key, value
        mask = _one_mask(graph, _mask_source(kwargs.get(mask_name)) if mask_name else None)
        if mask is not None:  # [Bm, 1, 1, L] -> [Bm, 1, g, L]: the same row for each folded query (no copy)
            bm, _, _, keys = fake_value(mask).shape
            mask = _call(graph, aten.unsqueeze.default, (mask, 2))
            mask = _call(graph, aten.expand.default, (mask, [bm, 1, groups, 1, keys]))
            mask = _call(graph, aten.view.default, (mask, [bm, 1, groups, keys]))
            if node.target in _FULL_MASK:
                mask = _call(graph, aten.expand.default, (mask, [batch, kv_heads, groups, keys]))
            folded[mask_name] = mask
        attention = _call(graph, node.target, (), folded)

    def result():
        out = _call(graph, operator.getitem, (attention, 0))
        # [B, Hk, g, D] in the kernel's query-major memory -> head order h * g + i, as the repeat had them.
        ordered = _call(graph, aten.clone.default, (out,), {"memory_format": torch.contiguous_format})
        return _call(graph, aten.view.default, (ordered, [batch, heads, 1, fake_value(out).shape[-1]]))

    _replace_result(graph, node, result)


def _decode_attention(graph: fx.Graph, node: fx.Node, kwargs: dict, mask_name: str | None, key: fx.Node,
                      value: fx.Node, impl: str) -> None:
    query = kwargs["query"]
    scale = kwargs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(fake_value(query).shape[-1])
    with graph.inserting_before(node):
        mask = _one_mask(graph, _mask_source(kwargs.get(mask_name)) if mask_name else None)
        out = _call(graph, torch.ops.opfuse.decode_attention.default, (query, key, value, mask, float(scale), impl))
    _replace_result(graph, node, lambda: out)


def fold_grouped_queries(gm: fx.GraphModule) -> tuple[int, list[str]]:
    """Rewrite every decode attention of ``gm`` that reads repeated key/value heads to read them
    unrepeated (module docstring). Returns how many were rewritten, and a note per attention over
    repeated heads: how it was rewritten, or why it was left."""
    setting = config.grouped_query_attention
    graph = gm.graph
    rewritten, notes = 0, []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ATTENTION or setting == "repeat":
            continue
        mask_name = _ATTENTION[node.target]
        normalized = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
        if normalized is None:
            continue
        kwargs = dict(normalized.kwargs)
        key, value = _repeated_heads(kwargs["key"]), _repeated_heads(kwargs["value"])
        if key is None or value is None:
            continue
        if key[1] != value[1]:
            notes.append(f"attention {node.name}: keys and values repeated {key[1]} and {value[1]} times")
            continue
        what = f"attention {node.name} over key/value heads repeated {key[1]} times"
        why = _why_not(node, kwargs, mask_name, key[1])
        if why is not None:
            notes.append(f"{what}: left repeated: {why}")
            continue
        query = fake_value(kwargs["query"])
        batch, kv_heads = query.shape[0], query.shape[1] // key[1]
        choice, forced = attention_op.choose_decode_attention(query, fake_value(key[0]), fake_value(value[0])) \
            if setting in ("auto", "decode_attention") else (None, False)
        repeats = [kwargs["key"], kwargs["value"]]
        # The reference (the fold through the op) only where forced: for tests and measurements.
        if choice is not None and (choice.name != "reference" or forced):
            _decode_attention(graph, node, kwargs, mask_name, key[0], value[0], choice.name)
            notes.append(f"{what}: decode_attention={choice.name}, the cache read unrepeated")
        elif setting == "fold" or batch * kv_heads >= MIN_FOLDED_HEADS:
            _fold(graph, node, kwargs, mask_name, key[0], value[0], key[1])
            notes.append(f"{what}: query groups folded into query positions, the cache read unrepeated")
        else:
            skipped = "; ".join(f"{name}: {reason}" for name, reason in choice.skipped) if choice else ""
            notes.append(f"{what}: left repeated: batch x key/value heads = {batch} x {kv_heads} < "
                         f"{MIN_FOLDED_HEADS} (folded, the SDPA kernels would run one block per key/value head, "
                         f"slower than over the repeated heads){'; ' + skipped if skipped else ''}")
            continue
        for repeat in repeats:  # view <- clone <- expand <- unsqueeze, now read by nothing (unless shared)
            while isinstance(repeat, fx.Node) and not repeat.users and repeat.op == "call_function":
                source = repeat.args[0]
                graph.erase_node(repeat)
                repeat = source if source is not key[0] and source is not value[0] else None
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten, notes
