"""opfuse settings: one object, ``opfuse.config``, overridable by ``OPFUSE_*`` environment variables.

Every field below is documented in the README ("Settings"). The environment is read when the
module is imported and again by ``opfuse.config.reload_from_env()``. Settings can be assigned
(``opfuse.config.fuse = False``) or changed for a scope::

    with opfuse.config.override(fuse=False):
        y = block(x)          # runs the unfused graph
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

__all__ = ["Config", "config", "override", "reload_from_env", "version"]


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
    #: (``opfuse/backend/residual_norm/crossovers.json``).
    oneshot_max_bytes: int = 0
    #: Largest message (bytes per rank) for the two-shot kernel; larger messages use NCCL + the
    #: local kernel (``OPFUSE_TWOSHOT_MAX_BYTES``); 0 = the measured crossover for the world size
    #: and row size (``opfuse/backend/residual_norm/crossovers.json``).
    twoshot_max_bytes: int = 0
    #: Sub-chunks in the comm+GEMM pipelines (``OPFUSE_OVERLAP_CHUNKS``): 0 = automatic (reduce-scatter:
    #: ring with two row halves when a rank's chunk has >= 1024 rows, else direct push-and-sum;
    #: all-gather: shards grouped into GEMMs of ~2 waves); 1 = direct reduce-scatter and one GEMM per
    #: gathered shard; n >= 2 = ring with n sub-chunks.
    overlap_chunks: int = 0
    #: A second GEMM stream in the comm+GEMM pipelines (``OPFUSE_OVERLAP_ALTERNATE_STREAMS``):
    #: ``auto`` = where a chunk GEMM's last wave is idle enough to be worth it, ``on``, ``off``.
    overlap_alternate_streams: str = "auto"
    #: How long a peer-memory wait (overlap signals) may spin before it fails, in milliseconds
    #: (``OPFUSE_PEER_TIMEOUT_MS``); 0 waits forever.
    peer_timeout_ms: int = 0
    #: How much opfuse logs through ``logging`` (``OPFUSE_LOG``): ``warning`` (quiet), ``info`` (the
    #: first-use nvcc build, pool growth, fallbacks to slower implementations, recompiles) or
    #: ``debug`` (also cache hits and every implementation choice); see opfuse/log.py.
    log: str = "warning"

    def __setattr__(self, name, value):
        global _version
        if name not in _FIELD_NAMES:
            raise AttributeError(f"opfuse.config has no setting {name!r}; known: {sorted(_FIELD_NAMES)}")
        choices = _CHOICES.get(name)
        if choices is not None and value not in choices:
            raise ValueError(f"opfuse.config.{name}={value!r}; accepted: {', '.join(map(repr, choices))}")
        if name in _NAME_LISTS:
            value = _name_list(f"opfuse.config.{name}", value)
        object.__setattr__(self, name, value)
        _version += 1

    def override(self, **settings):
        """Context manager: change settings inside a ``with`` block."""
        return override(**settings)

    def reload_from_env(self, environ=None) -> None:
        """Reset to defaults, then apply ``OPFUSE_*`` variables."""
        reload_from_env(environ)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Config))
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
    "peer_timeout_ms": "PEER_TIMEOUT_MS",
    "log": "LOG",
}
#: Settings restricted to a set of values.
_CHOICES = {"overlap_alternate_streams": ("auto", "on", "off"), "log": ("warning", "info", "debug")}
#: Settings holding names (a comma-separated string or a sequence of strings, stored as a tuple).
_NAME_LISTS = ("disabled_passes",)


def _name_list(source: str, value: Any) -> tuple[str, ...]:
    """``value`` as a tuple of names: a comma-separated string or a sequence of strings, each an
    identifier-like name (letters, digits, ``_`` or ``-``)."""
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
        if value.strip() and not all(items):
            raise ValueError(f"{source}={value!r}: an empty name between commas; expected name1,name2")
        items = [item for item in items if item]
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        raise ValueError(f"{source}={value!r}: expected names (a comma-separated string or a tuple of strings)")
    for item in items:
        if not isinstance(item, str) or not item.replace("-", "_").isidentifier():
            raise ValueError(f"{source}={value!r}: {item!r} is not a pass name; expected name1,name2")
    return tuple(items)

_version = 0
config = Config()


def version() -> int:
    """A counter bumped on every settings change; compiled-program caches key on it."""
    return _version


def _parse(field: dataclasses.Field, raw: str, source: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    if kind == "bool":
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{source}={raw!r}: expected one of 1/0/true/false/yes/no/on/off")
    if kind == "int":
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{source}={raw!r}: expected an integer") from None
        if value < 0:
            raise ValueError(f"{source}={raw!r}: expected a non-negative integer")
        return value
    if field.name in _NAME_LISTS:
        return _name_list(source, raw)
    if field.name in _CHOICES:
        low = raw.strip().lower()
        if low not in _CHOICES[field.name]:
            raise ValueError(f"{source}={raw!r}: expected one of {'/'.join(_CHOICES[field.name])}")
        return low
    if kind.startswith("tuple"):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    return raw


def reload_from_env(environ: dict[str, str] | None = None) -> None:
    """Reset every setting to its default, then apply ``OPFUSE_*`` variables."""
    environ = os.environ if environ is None else environ
    fresh = Config()
    for field in dataclasses.fields(Config):
        name = _ENV_PREFIX + _ENV_NAMES[field.name]
        if name in environ:
            setattr(fresh, field.name, _parse(field, environ[name], name))
    for field in dataclasses.fields(Config):
        setattr(config, field.name, getattr(fresh, field.name))


@contextlib.contextmanager
def override(**settings: Any) -> Iterator[Config]:
    """Change settings inside a ``with`` block; the previous values come back afterwards."""
    names = _FIELD_NAMES
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(f"opfuse.config.override: unknown setting(s) {unknown}; known: {sorted(names)}")
    saved = {name: getattr(config, name) for name in settings}
    for name, value in settings.items():
        if name == "disabled_rules" and isinstance(value, str):
            value = (value,)
        setattr(config, name, tuple(value) if name == "disabled_rules" else value)
    try:
        yield config
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


reload_from_env()
