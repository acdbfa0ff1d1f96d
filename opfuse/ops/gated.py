"""The gated layer of SwiGLU / GeGLU MLPs: :class:`GatedLinear`, with separate gate and up weights.

``y = act(x @ gate_weight.T + gate_bias) * (x @ up_weight.T + up_bias)``

Holding the two projections as two parameters makes the tensor-parallel layout unambiguous: a
column-parallel rank holds rows ``r`` of the gate and rows ``r`` of the up projection, each
loaded from its own full matrix. (Loading ``torch.cat([gate, up])`` into one column-parallel
``Linear`` and halving each rank's shard pairs the wrong features at world >= 2; ``SwiGLU``
refuses sharded features for that reason.) The layer expands into two GEMMs that read the same
input and a :class:`~opfuse.ops.GatedActivation`; the ``horizontal_gemm`` pass runs the two GEMMs
as one over ``[gate_r; up_r]``, which needs no copy because the layer keeps both weights in one
buffer (:func:`~opfuse.ops.packing.pack_rows_`, also after ``.to()``).
"""

from __future__ import annotations

import torch
from torch import nn

from . import group as groups
from .activation import ACTIVATIONS, GatedActivation
from .base import BasicOp, PartitionError, TensorMeta
from .expansion import INPUT, Step, evaluate
from .linear import BasicLinear, Bias, _init_weight_, check_group_unchanged, gemm_input_plan
from .packing import pack_rows_
from .sharding import REPLICATED, Sharding, reject_partial

__all__ = ["GatedLinear"]

_PARALLEL_MODES = (None, "column")


class GatedLinear(BasicOp):
    """A gated linear layer (the first half of a SwiGLU / GeGLU MLP) with *global* sizes.

    Parameters
    ----------
    in_features, out_features:
        Global sizes: ``x [..., in_features] -> y [..., out_features]`` (``out_features`` is the
        MLP's ffn size; the layer holds ``2 * out_features`` rows of weights in all).
    bias:
        Add ``gate_bias`` and ``up_bias`` before the activation.
    parallel:
        ``None`` or ``"column"`` (each rank holds ``out_features / world`` rows of the gate and
        of the up weight; the output is sharded on features, ready for a row-parallel Linear).
    sequence_parallel:
        Tokens (dim 0) of the input are sharded; the layer all-gathers them once for both GEMMs.
    activation:
        ``"silu"`` (SwiGLU, default), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU).
    group:
        The tensor-parallel ``ProcessGroup``; ``None`` means the default group.

    Attributes ``gate_weight``, ``up_weight`` (``[out_features / world, in_features]``) and
    ``gate_bias``, ``up_bias`` are this rank's shards.

    Examples
    --------
    >>> fc1 = ops.GatedLinear(8192, 28672, parallel="column", group=tp)       # doctest: +SKIP
    >>> fc1.load_unsharded(gate=hf["gate_proj.weight"], up=hf["up_proj.weight"])  # doctest: +SKIP
    >>> mlp = ops.Sequential(ops.RMSNorm(8192), fc1,
    ...                      ops.Linear(28672, 8192, bias=False, parallel="row", group=tp))  # doctest: +SKIP
    """

    is_composite = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel=None,
                 sequence_parallel: bool = False, activation: str = "silu", group=None, device=None, dtype=None):
        super().__init__()
        if parallel not in _PARALLEL_MODES:
            hint = ("; a gated activation needs whole pre-activations, which a row-parallel GEMM leaves as partial "
                    "sums") if parallel == "row" else ""
            raise ValueError(f"GatedLinear: parallel={parallel!r}; accepted: None, 'column'{hint}")
        if sequence_parallel and parallel is None:
            raise ValueError("GatedLinear: sequence_parallel=True needs parallel='column'")
        if activation not in ACTIVATIONS:
            raise ValueError(f"GatedLinear: activation={activation!r}; accepted: {', '.join(map(repr, ACTIVATIONS))}")
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GatedLinear: {name}={value!r}; expected a positive int")
        for name, value in (("bias", bias), ("sequence_parallel", sequence_parallel)):
            if not isinstance(value, bool):
                raise TypeError(f"GatedLinear: {name}={value!r}; expected True or False")
        self.in_features, self.out_features = in_features, out_features
        self.parallel, self.sequence_parallel = parallel, bool(sequence_parallel)
        self.group = groups.check(group, "GatedLinear")
        self.activation = activation
        self.world_size = groups.world_size(group, "GatedLinear") if parallel else 1
        self.rank = groups.rank(group, "GatedLinear") if parallel else 0
        if out_features % self.world_size:
            raise ValueError(f"GatedLinear(parallel='column'): out_features={out_features} is not divisible by the "
                             f"world size {self.world_size}")
        rows = out_features // self.world_size
        # One buffer for both weights (and one for both biases): the fused GEMM reads them as one.
        weights = torch.empty(2 * rows, in_features, device=device, dtype=dtype)
        _init_weight_(weights, in_features)
        self.gate_weight = nn.Parameter(weights[:rows])
        self.up_weight = nn.Parameter(weights[rows:])
        if bias:
            biases = torch.zeros(2 * rows, device=device, dtype=dtype)
            self.gate_bias = nn.Parameter(biases[:rows])
            self.up_bias = nn.Parameter(biases[rows:])
        else:
            self.register_parameter("gate_bias", None)
            self.register_parameter("up_bias", None)
        self._expansions: dict[Sharding, tuple[list[Step], Sharding]] = {}

    def extra_repr(self) -> str:
        text = (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.gate_bias is not None}, "
                f"activation={self.activation!r}")
        if self.parallel:
            text += f", parallel={self.parallel!r}, world={self.world_size}"
        if self.sequence_parallel:
            text += ", sequence_parallel=True"
        return text

    @property
    def local_out_features(self) -> int:
        return self.gate_weight.shape[0]

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .double() move each parameter on its own; put the pairs back into one
        # buffer so the fused GEMM keeps reading them without a copy.
        result = super()._apply(fn, *args, **kwargs)
        pack_rows_([self.gate_weight, self.up_weight])
        if self.gate_bias is not None:
            pack_rows_([self.gate_bias, self.up_bias])
        return result

    # Sharding -----------------------------------------------------------------------------

    def process_groups(self) -> list:
        return [self.group] if self.parallel else []

    def natural_input_sharding(self, x: TensorMeta | None = None) -> Sharding | None:
        if self.parallel is None:
            return None
        return Sharding(tokens=self.sequence_parallel, group=self.group)

    def expand(self, sharding: Sharding) -> tuple[list[Step], Sharding]:
        """The collectives :func:`~opfuse.ops.sharding.plan_gemm` requires for a column-parallel
        GEMM (shared by both projections), the gate GEMM (+ bias), the up GEMM (+ bias) on the
        same input, and the gated activation; and the output's layout."""
        check_group_unchanged(self, "GatedLinear")
        reject_partial(self, sharding)
        if self.parallel is None:
            if sharding.features:
                raise PartitionError(f"{self.describe()}: its input is sharded on features but the layer is not "
                                     f"parallel; a gated layer needs every input feature")
            pre, out, weight_sharding = [], sharding, None
        else:
            pre, _, (tokens, features) = gemm_input_plan(self, sharding, rhs_k=False, rhs_n=True)
            out = Sharding(tokens=tokens, features=features, group=self.group)
            weight_sharding = "out"
        steps = [Step(op, (index - 1 if index else INPUT,)) for index, op in enumerate(pre)]
        source = len(steps) - 1 if steps else INPUT
        branches = []
        for label, weight, bias in (("gate", self.gate_weight, self.gate_bias), ("up", self.up_weight, self.up_bias)):
            steps.append(Step(BasicLinear(self.in_features, weight.shape[0], weight=weight,
                                          weight_sharding=weight_sharding), (source,), label))
            if bias is not None:
                steps.append(Step(Bias(bias.shape[0], bias=bias), (len(steps) - 1,), f"{label}_bias"))
            branches.append(len(steps) - 1)
        steps.append(Step(GatedActivation(self.activation), tuple(branches)))
        return steps, out

    def _expansion(self, sharding: Sharding):
        if sharding not in self._expansions:
            self._expansions[sharding] = self.expand(sharding)
        return self._expansions[sharding]

    # Loading ------------------------------------------------------------------------------

    def load_unsharded(self, gate: torch.Tensor | None = None, up: torch.Tensor | None = None,
                       gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None, *,
                       gate_up: torch.Tensor | None = None, gate_up_bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of the full weights: ``gate`` and ``up`` (``[out, in]`` each,
        e.g. Hugging Face's ``gate_proj`` / ``up_proj``), or ``gate_up = torch.cat([gate, up])``
        (``[2 * out, in]``, a merged checkpoint); biases likewise (``[out]`` each, or
        ``gate_up_bias [2 * out]``)."""
        if gate_up is not None:
            if gate is not None or up is not None:
                raise ValueError("GatedLinear.load_unsharded: pass gate= and up=, or gate_up=, not both")
            gate, up = self._halves(gate_up, (2 * self.out_features, self.in_features), "gate_up")
        if gate_up_bias is not None:
            if gate_bias is not None or up_bias is not None:
                raise ValueError("GatedLinear.load_unsharded: pass gate_bias= and up_bias=, or gate_up_bias=, not both")
            gate_bias, up_bias = self._halves(gate_up_bias, (2 * self.out_features,), "gate_up_bias")
        if gate is None or up is None:
            raise ValueError("GatedLinear.load_unsharded: pass both gate= and up= (or gate_up=)")
        if (gate_bias is None) != (up_bias is None):
            raise ValueError("GatedLinear.load_unsharded: pass both gate_bias= and up_bias=, or neither")
        if gate_bias is not None and self.gate_bias is None:
            raise ValueError("GatedLinear.load_unsharded: got biases but the layer has bias=False")
        pairs = [(self.gate_weight, gate, "gate", (self.out_features, self.in_features)),
                 (self.up_weight, up, "up", (self.out_features, self.in_features))]
        if gate_bias is not None:
            pairs += [(self.gate_bias, gate_bias, "gate_bias", (self.out_features,)),
                      (self.up_bias, up_bias, "up_bias", (self.out_features,))]
        rows = self.local_out_features
        with torch.no_grad():
            for param, full, name, shape in pairs:
                if tuple(full.shape) != shape:
                    raise ValueError(f"GatedLinear.load_unsharded: {name} has shape {list(full.shape)}, expected "
                                     f"{list(shape)}")
                param.copy_(full[self.rank * rows:(self.rank + 1) * rows])

    @staticmethod
    def _halves(full: torch.Tensor, shape: tuple, name: str):
        if tuple(full.shape) != shape:
            raise ValueError(f"GatedLinear.load_unsharded: {name} has shape {list(full.shape)}, expected "
                             f"{list(shape)} (torch.cat([gate, up]))")
        return full.chunk(2, dim=0)

    # Reference ----------------------------------------------------------------------------

    def forward(self, x):
        steps, _ = self._expansion(self.natural_input_sharding(TensorMeta.of(x)) or REPLICATED)
        return evaluate(steps, x, (), lambda step, args, extra: step.op(*args, *extra))

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        """Metadata for an input in the layer's natural layout."""
        steps, _ = self._expansion(self.natural_input_sharding(x) or REPLICATED)
        return evaluate(steps, x, (), lambda step, args, taken: step.op.infer_meta(*args, *taken))
