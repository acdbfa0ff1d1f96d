"""opfuse settings: one object, ``opfuse.config``, overridable by ``OPFUSE_*`` environment variables.

Every field below is documented in docs/guide.md ("Settings"). The environment is read when the
module is imported and again by ``opfuse.config.reload_from_env()``. Settings can be assigned
(``opfuse.config.fuse = False``) or changed for a scope::

    with opfuse.config.override(fuse=False):
        y = block(x)          # runs the unfused graph

Each setting has one validator, used both for its environment variable and for assignments in
code: a value it does not accept raises ``ValueError`` naming the variable (or the attribute) and
the accepted values. Text is what environment variables hold: ``OPFUSE_FUSE=no`` and
``OPFUSE_SYMM_POOL_MB=64`` are read as ``False`` and ``64``, while code assigns the setting's own
type (``opfuse.config.fuse = False``; ``"no"`` or ``0`` there is an error: a string is truthy, and
taking it for its meaning in one place but not another is how a setting silently does the
opposite). Names that only exist once the package is loaded (rule names, fused-op and
implementation names) are checked where they are used, when a program is compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Callable, Iterator, Mapping

from . import epoch

__all__ = ["Config", "config", "override", "reload_from_env", "version", "snapshot", "parse_force_impl"]


@dataclasses.dataclass
class Config:
    """The settings (see the module docstring). Assigning a field invalidates compiled programs."""

    #: Apply fusion rules when compiling (``OPFUSE_FUSE=0`` runs the unfused graph).
    fuse: bool = True
    #: Rule names never applied (``OPFUSE_DISABLE_RULES=name1,name2``).
    disabled_rules: tuple[str, ...] = ()
    #: Registered or built-in passes never run (``OPFUSE_DISABLE_PASSES=name1,name2``); names are
    #: checked against the pipeline when a program is compiled (``opfuse.passes.passes()``).
    disabled_passes: tuple[str, ...] = ()
    #: Force implementations: ``"fused_op=impl,..."`` (fused-op names as in ``doctor``, e.g.
    #: ``allreduce_add_rmsnorm=cuda_twoshot``) or a bare implementation name, used for every fused
    #: op that has one (``OPFUSE_FORCE_IMPL``). A forced implementation that is not capable is an
    #: error, not a fallback.
    force_impl: str = ""
    #: Directory that receives the graph after every pass of every compiled program
    #: (``OPFUSE_DUMP``); empty disables dumping.
    dump_dir: str = ""
    #: Run the verify pass after the pipeline (``OPFUSE_VERIFY``).
    verify: bool = True
    #: Use the CUDA extension when a GPU and nvcc are present (``OPFUSE_CUDA=0`` disables it).
    cuda: bool = True
    #: Build/cache directory of the CUDA extension (``OPFUSE_CACHE_DIR``).
    cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "opfuse")
    #: Symmetric-memory pool size per process group in MiB (``OPFUSE_SYMM_POOL_MB``).
    symm_pool_mb: int = 512
    #: Upper bound of a group's symmetric pool (all segments) in MiB (``OPFUSE_SYMM_POOL_MAX_MB``).
    symm_pool_max_mb: int = 4096
    #: Largest message (bytes per rank) for the one-shot Lamport kernel (``OPFUSE_ONESHOT_MAX_BYTES``);
    #: 0 = the measured crossover for the group's world size and row size
    #: (``opfuse/families/residual_norm/crossovers.json``).
    oneshot_max_bytes: int = 0
    #: Largest message (bytes per rank) for the two-shot kernel; larger messages use NCCL + the
    #: local kernel (``OPFUSE_TWOSHOT_MAX_BYTES``); 0 = the measured crossover for the world size
    #: and row size (``opfuse/families/residual_norm/crossovers.json``).
    twoshot_max_bytes: int = 0
    #: Sub-chunks in the comm+GEMM pipelines (``OPFUSE_OVERLAP_CHUNKS``): 0 = automatic (reduce-scatter:
    #: ring with two row halves when a rank's chunk has >= 1024 rows, else direct push-and-sum;
    #: all-gather: shards grouped into GEMMs of ~2 waves); 1 = direct reduce-scatter and one GEMM per
    #: gathered shard; n >= 2 = ring with n sub-chunks.
    overlap_chunks: int = 0
    #: A second GEMM stream in the comm+GEMM pipelines (``OPFUSE_OVERLAP_ALTERNATE_STREAMS``):
    #: ``auto`` = where a chunk GEMM's last wave is idle enough to be worth it, ``on``, ``off``.
    overlap_alternate_streams: str = "auto"
    #: Collectives in compiled models (``OPFUSE_OVERLAP_COLLECTIVES``): ``auto`` leaves a collective to
    #: NCCL, asynchronous and scheduled under independent GEMMs, where those GEMMs can hide it (a
    #: backward all-reduce or reduce-scatter next to the weight-gradient GEMMs), fuses it elsewhere,
    #: moves weight-only work (FP8 weight casts) under the forward collectives and a weight-gradient
    #: GEMM under each backward collective that has none; ``fuse`` fuses every collective a rule
    #: matches and keeps the traced order.
    overlap_collectives: str = "auto"
    #: Chunks of a row-parallel GEMM whose forward all-reduce runs chunk by chunk under the next
    #: chunk's GEMM (``OPFUSE_ALLREDUCE_CHUNKS``; opfuse/torch_compile/chunked_all_reduce.py): 0 =
    #: auto (chunks of >= 2048 tokens, at most 4), 1 = never split, n >= 2 = n chunks. Only with
    #: ``overlap_collectives="auto"`` and outside FP8 graphs. Off by default: it replaces opfuse's
    #: fused all-reduce + add + norm, which costs less than NCCL's all-reduce alone from 1024 tokens,
    #: so a whole model ran 0.7% slower with it (docs/PERF_NOTES.md "Results, session 20").
    allreduce_chunks: int = 1
    #: SMs that the GEMMs scheduled under a collective left to NCCL leave free for it
    #: (``OPFUSE_OVERLAP_SM_CARVEOUT``; 0 = all SMs to the GEMMs): cuBLAS's persistent GEMMs hold
    #: every SM until they end, so inside a CUDA graph NCCL's kernel may wait for them instead of
    #: running under them (opfuse/torch_compile/sm_carveout.py); covers the GEMMs under every
    #: backward collective (reductions and the gathers given a weight gradient). Off: it moves
    #: NCCL's kernels under the GEMMs, but both then run slower by what the overlap hides
    #: (docs/PERF_NOTES.md, "Results, session 21").
    overlap_sm_carveout: int = 0
    #: Compiled training graphs: the backward's gradient all-gathers that no GEMM fusion takes run
    #: over peer memory, pushed by the copy engines (``OPFUSE_P2P_GRADIENT_GATHERS``;
    #: ``all_gather_tokens``' ``p2p_overlap``); off keeps NCCL's asynchronous gather. Off: exact on
    #: GPUs, but in line it is no faster than NCCL's gather (1.02x at 16 MiB per rank on 2x H200;
    #: docs/PERF_NOTES.md, "The backward all-gathers over peer memory").
    p2p_gradient_gathers: bool = False
    #: Compiled models: how a decode attention (one query position) over key/value heads repeated
    #: for grouped-query attention (``repeat_interleave`` / Hugging Face's ``repeat_kv``) reads the
    #: cache (``OPFUSE_GROUPED_QUERY_ATTENTION``; opfuse/torch_compile/grouped_attention.py):
    #: ``auto`` unrepeated: by opfuse's ``decode_attention`` (Triton kernels split over the cache's
    #: positions) where its kernels take the call, else by folding the query groups into query
    #: positions of the SDPA call where batch x key/value heads >= 16, else repeated (measured:
    #: docs/PERF_NOTES.model.md, sessions 23-24); ``fold`` always by the fold; ``decode_attention``
    #: by ``decode_attention`` where an implementation runs (its reference too where forced), else
    #: as ``auto``; ``repeat`` as the model writes it.
    grouped_query_attention: str = "auto"
    #: Fusions in graphs Inductor compiles that only their reference implementation could run
    #: (``OPFUSE_REFERENCE_FUSIONS``), for fused ops whose reference runs the very aten ops they
    #: cover (add + norm, all-reduce + add + norm, GEMM + bias + activation): Inductor's own code for
    #: those is as good or better, so ``auto`` leaves them to Inductor on CUDA devices (e.g. an add
    #: + norm over a float32 residual and bfloat16 activations, which the kernels refuse),
    #: ``inductor`` does so on every device, ``keep`` always fuses. ``explain()`` lists them. The
    #: same applies to a standalone add + norm (no collective) whatever kernel could run it: Inductor
    #: fuses those ops into one kernel itself, with no custom op's host time per call.
    reference_fusions: str = "auto"
    #: Compiled FP8 graphs with power-of-two weight scales: the weight casts of one shape between two
    #: collectives run as one launch, in batches of at most this many MiB of FP8 output
    #: (``OPFUSE_FP8_WEIGHT_BATCH_MB``; 0 = each cast alone). Per cast, the host time of two
    #: launches and four allocations is paid once per batch; the cap bounds the peak memory a cast
    #: moved ahead of its layer adds (opfuse/torch_compile/batch_weight_casts.py).
    fp8_weight_batch_mb: int = 256
    #: Compiled FP8 graphs: the FP8 producers (add + norm + quantize, quantize) written as aten ops
    #: that Inductor fuses and launches, instead of opfuse's Triton kernels behind a custom op
    #: (``OPFUSE_FP8_ATEN``): ``auto`` where the graph runs without CUDA graphs (a custom-op call
    #: costs ~100 us of host time there; opfuse/torch_compile/fp8_aten.py), ``always`` everywhere,
    #: and then the collective FP8 GEMMs too (functional collectives + ``torch._scaled_mm``, not
    #: yet measured on GPUs), ``never``. The all-reduce + add + RMSNorm + quantize keeps its
    #: peer-memory kernels.
    fp8_aten: str = "auto"
    #: opfuse's own Triton kernels launch through a dict of compiled kernels keyed by what Triton
    #: specializes on, skipping Triton's per-call argument binding (``OPFUSE_TRITON_LAUNCH_CACHE``;
    #: opfuse/runtime/triton_launch.py); off launches every one through ``kernel[grid](...)``.
    triton_launch_cache: bool = True
    #: Launch the all-reduce + norm peer kernels with programmatic dependent launch, so their launch
    #: overlaps the tail of the kernel before them (``OPFUSE_PDL``; outputs are bit-identical either
    #: way). On: 0.4-0.9 us faster per call at 1-64 tokens on 2x H200 (docs/PERF_NOTES.md, issue 30).
    pdl: bool = True
    #: How long opfuse waits for a peer before it fails, in milliseconds (``OPFUSE_PEER_TIMEOUT_MS``):
    #: the peer-memory kernels' and the overlap plans' waits, and the compile-time check that every
    #: rank compiled the same program. 0 waits forever. The default is NCCL's default process-group
    #: timeout (10 minutes).
    peer_timeout_ms: int = 600_000
    #: How much opfuse logs through ``logging`` (``OPFUSE_LOG``): ``warning`` (quiet), ``info`` (the
    #: first-use nvcc build, pool growth, fallbacks to slower implementations, recompiles) or
    #: ``debug`` (also cache hits and every implementation choice); see opfuse/log.py.
    log: str = "warning"
    #: Whether ranks check that a block's replicated inputs are the same tensor
    #: (``OPFUSE_CHECK_REPLICATED``): ``compile`` (when a block compiles for an input signature:
    #: a digest joins the signature the ranks exchange anyway; token-sharded inputs equal on every
    #: rank, the whole sequence given to each, draw a warning), ``always`` (also every call: a
    #: collective and a host synchronisation per call, for debugging; equal token shards raise)
    #: or ``off``. See opfuse/sequential/replicated.py.
    check_replicated: str = "compile"

    def __setattr__(self, name, value):
        if name not in _VALIDATORS:
            raise AttributeError(f"opfuse.config has no setting {name!r}; known: {sorted(_VALIDATORS)}")
        value = _VALIDATORS[name](value, f"opfuse.config.{name}", text=False)
        if name in self.__dict__ and _same(self.__dict__[name], value):
            return
        object.__setattr__(self, name, value)
        global _version
        _version += 1
        epoch.bump()

    def __delattr__(self, name):
        # ``del opfuse.config.fuse`` would leave the class default visible but drop the value from
        # the instance, which snapshot() and the program caches read: every later compile failed
        # with a KeyError far from here.
        raise AttributeError(f"opfuse.config.{name}: settings cannot be deleted; assign a value, or use "
                             f"opfuse.config.override(...) / reload_from_env() to restore the defaults")

    def override(self, **settings):
        """Context manager: change settings inside a ``with`` block."""
        return override(**settings)

    def reload_from_env(self, environ=None) -> None:
        """Reset to defaults, then apply ``OPFUSE_*`` variables."""
        reload_from_env(environ)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


# Validators: value (from code, or the text of an environment variable) -> the setting's value.

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: Rule names, fused-op names and implementation names (``nccl+cuda``, ``p2p_overlap``, ...).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.+-]*$")


# ``text``: the value is an environment variable's text (else it was assigned in code, where a
# setting takes its own type).


def _boolean(value, where: str, text: bool = True) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if text:
        raise ValueError(f"{where}={value!r}: expected True or False (as text: {'/'.join(_TRUE + _FALSE)})")
    raise ValueError(f"{where}={value!r}: expected True or False (a bool; text such as 'no' is read only from the "
                     f"environment variable)")


def _integer(minimum: int) -> Callable[..., int]:
    def check(value, where: str, text: bool = True) -> int:
        number = value
        if isinstance(value, str) and text:
            try:
                number = int(value.strip())
            except ValueError:
                number = None
        if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
            hint = "" if text or not isinstance(value, str) else \
                " (an int; text is read only from the environment variable)"
            raise ValueError(f"{where}={value!r}: expected an integer >= {minimum}{hint}")
        return number

    return check


def _text(allow_empty: bool) -> Callable[..., str]:
    def check(value, where: str, text: bool = True) -> str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or (not allow_empty and not value.strip()):
            raise ValueError(f"{where}={value!r}: expected a {'' if allow_empty else 'non-empty '}string")
        return value

    return check


def _choice(*accepted: str) -> Callable[..., str]:
    def check(value, where: str, text: bool = True) -> str:
        if isinstance(value, str) and value.strip().lower() in accepted:
            return value.strip().lower()
        raise ValueError(f"{where}={value!r}: expected one of {', '.join(map(repr, accepted))}")

    return check


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _name(item, where: str, what: str) -> str:
    if not isinstance(item, str) or not _NAME.match(item.strip()):
        raise ValueError(f"{where}: {item!r} is not {_article(what)} {what} name (letters, digits, '_', '.', '+', "
                         f"'-')")
    return item.strip()


def _names(what: str) -> Callable[..., tuple[str, ...]]:
    """Comma-separated text or a sequence of ``what`` names; which names exist is checked when a
    program is compiled (the rules and passes are registered by then)."""

    def check(value, where: str, text: bool = True) -> tuple[str, ...]:
        source = f"{where}={value!r}"
        if isinstance(value, str):
            if ";" in value:
                raise ValueError(f"{source}: {value.strip()!r} is not {_article(what)} {what} name; separate "
                                 f"{what} names with commas (name1,name2)")
            items = [part.strip() for part in value.split(",")] if value.strip() else []
            if not all(items):
                raise ValueError(f"{source}: an empty name between commas; expected name1,name2")
        elif isinstance(value, (tuple, list, set, frozenset)):
            items = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
        else:
            raise ValueError(f"{source}: expected names ({what} names, comma-separated or a tuple of strings)")
        return tuple(dict.fromkeys(_name(item, source, what) for item in items))

    return check


def parse_force_impl(value, where: str = "opfuse.config.force_impl") -> dict[str | None, str]:
    """``force_impl`` as ``{fused-op name or None (every op that has it): implementation name}``.

    Accepted: ``""``, a bare implementation name, ``"op=impl,op2=impl2"``, or a mapping. Which
    names exist is checked when a program chooses its implementations."""
    if isinstance(value, Mapping):
        items = [(_name(k, where, "fused op"), _name(v, where, "implementation")) for k, v in value.items()]
        return dict(items)
    if not isinstance(value, str):
        raise ValueError(f"{where}={value!r}: expected 'impl', 'op=impl,op2=impl2' or a dict")
    text = value.strip()
    if not text:
        return {}
    if ";" in text:
        raise ValueError(f"{where}={value!r}: separate entries with commas ('op=impl,op2=impl2')")
    if "=" not in text:
        if "," in text:
            raise ValueError(f"{where}={value!r}: a bare implementation name applies to every fused op; "
                             f"name the ops to force several ('op=impl,op2=impl2')")
        return {None: _name(text, f"{where}={value!r}", "implementation")}
    forced: dict[str | None, str] = {}
    for item in text.split(","):
        key, equals, impl = item.partition("=")
        if not equals or not key.strip() or not impl.strip():
            raise ValueError(f"{where}={value!r}: entry {item.strip()!r} is not 'op=impl'")
        key = _name(key, f"{where}={value!r}", "fused op")
        if key in forced:
            raise ValueError(f"{where}={value!r}: fused op {key!r} is forced twice")
        forced[key] = _name(impl, f"{where}={value!r}", "implementation")
    return forced


def _force_impl(value, where: str, text: bool = True) -> str:
    forced = parse_force_impl(value, where)
    if None in forced:
        return forced[None]
    return ",".join(f"{op}={impl}" for op, impl in forced.items())


#: One validator per setting (the environment and assignments both go through it):
#: ``validator(value, where, text=...)``.
_VALIDATORS: dict[str, Callable[..., Any]] = {
    "fuse": _boolean,
    "disabled_rules": _names("rule"),
    "disabled_passes": _names("pass"),
    "force_impl": _force_impl,
    "dump_dir": _text(allow_empty=True),
    "verify": _boolean,
    "cuda": _boolean,
    "cache_dir": _text(allow_empty=False),
    "symm_pool_mb": _integer(1),
    "symm_pool_max_mb": _integer(1),
    "oneshot_max_bytes": _integer(0),
    "twoshot_max_bytes": _integer(0),
    "overlap_chunks": _integer(0),
    "overlap_alternate_streams": _choice("auto", "on", "off"),
    "overlap_collectives": _choice("auto", "fuse"),
    "allreduce_chunks": _integer(0),
    "overlap_sm_carveout": _integer(0),
    "p2p_gradient_gathers": _boolean,
    "grouped_query_attention": _choice("auto", "fold", "decode_attention", "repeat"),
    "reference_fusions": _choice("auto", "inductor", "keep"),
    "fp8_weight_batch_mb": _integer(0),
    "fp8_aten": _choice("auto", "always", "never"),
    "triton_launch_cache": _boolean,
    "pdl": _boolean,
    "peer_timeout_ms": _integer(0),
    "log": _choice("warning", "info", "debug"),
    "check_replicated": _choice("compile", "always", "off"),
}
_ENV_PREFIX = "OPFUSE_"
_ENV_NAMES = {
    "fuse": "FUSE",
    "disabled_rules": "DISABLE_RULES",
    "disabled_passes": "DISABLE_PASSES",
    "force_impl": "FORCE_IMPL",
    "dump_dir": "DUMP",
    "verify": "VERIFY",
    "cuda": "CUDA",
    "cache_dir": "CACHE_DIR",
    "symm_pool_mb": "SYMM_POOL_MB",
    "symm_pool_max_mb": "SYMM_POOL_MAX_MB",
    "oneshot_max_bytes": "ONESHOT_MAX_BYTES",
    "twoshot_max_bytes": "TWOSHOT_MAX_BYTES",
    "overlap_chunks": "OVERLAP_CHUNKS",
    "overlap_alternate_streams": "OVERLAP_ALTERNATE_STREAMS",
    "overlap_collectives": "OVERLAP_COLLECTIVES",
    "allreduce_chunks": "ALLREDUCE_CHUNKS",
    "overlap_sm_carveout": "OVERLAP_SM_CARVEOUT",
    "p2p_gradient_gathers": "P2P_GRADIENT_GATHERS",
    "grouped_query_attention": "GROUPED_QUERY_ATTENTION",
    "reference_fusions": "REFERENCE_FUSIONS",
    "fp8_weight_batch_mb": "FP8_WEIGHT_BATCH_MB",
    "fp8_aten": "FP8_ATEN",
    "triton_launch_cache": "TRITON_LAUNCH_CACHE",
    "pdl": "PDL",
    "peer_timeout_ms": "PEER_TIMEOUT_MS",
    "log": "LOG",
    "check_replicated": "CHECK_REPLICATED",
}
assert set(_VALIDATORS) == set(_ENV_NAMES) == {f.name for f in dataclasses.fields(Config)}

_version = 0
config = Config()


def env_name(setting: str) -> str:
    """The environment variable of ``setting`` (``"dump_dir"`` -> ``"OPFUSE_DUMP"``)."""
    return _ENV_PREFIX + _ENV_NAMES[setting]


def version() -> int:
    """A counter bumped on every settings change."""
    return _version


def snapshot() -> tuple:
    """The values of every setting, in field order (compiled-program caches key on it, so toggling
    a setting back finds the programs compiled under the old value)."""
    return tuple(config.__dict__[name] for name in _ENV_NAMES)


def reload_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Reset every setting to its default, then apply ``OPFUSE_*`` variables. Every variable is
    validated before any setting changes."""
    environ = os.environ if environ is None else environ
    values = {}
    for field in dataclasses.fields(Config):
        name = env_name(field.name)
        raw = environ.get(name)
        values[field.name] = field.default if raw is None else _VALIDATORS[field.name](raw, name)
    for name, value in values.items():
        setattr(config, name, value)


@contextlib.contextmanager
def override(**settings: Any) -> Iterator[Config]:
    """Change settings inside a ``with`` block; the previous values come back afterwards."""
    unknown = sorted(set(settings) - set(_VALIDATORS))
    if unknown:
        raise TypeError(f"opfuse.config.override: unknown setting(s) {unknown}; known: {sorted(_VALIDATORS)}")
    saved = {name: getattr(config, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(config, name, value)
        yield config
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


reload_from_env()
