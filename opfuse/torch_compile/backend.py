"""The ``"opfuse"`` torch.compile backend, :func:`optimize` and :func:`programs`.

``torch.compile(model, backend="opfuse")`` compiles like Inductor (same decompositions,
partitioner, code generation, ``mode=`` and ``options=``), with opfuse's fusions applied to every
graph first (:mod:`.graph_pass`): what the rules match becomes calls to opfuse's custom ops,
everything else stays Inductor's. ``options={"inductor": False}`` runs the fused aten graphs
eagerly instead (AOTAutograd with Inductor's decompositions and partitioner, no code
generation): quick to compile, for debugging and CPU tests.

The name is found through the ``torch_dynamo_backends`` entry point when opfuse is installed, and
registered when ``opfuse`` is imported otherwise (e.g. used from a source tree on ``PYTHONPATH``).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["OpfuseBackend", "opfuse_backend", "optimize", "programs", "register"]

#: Keys of ``options=`` that opfuse reads; the rest go to Inductor's config.
OPFUSE_OPTIONS = ("inductor", "fp8", "fp8_filter")


class OpfuseBackend:
    """A torch.compile backend that applies opfuse's rules to each graph, then compiles it with
    Inductor. ``programs`` holds a :class:`~opfuse.torch_compile.program.GraphProgram` per graph
    compiled (training graphs: forward and backward together; inference graphs).

    ``fp8`` / ``fp8_filter``: the FP8 recipe and layer filter (:mod:`.fp8`); ``model``: the module
    being compiled, whose parameters name the graphs' inputs (found from Dynamo's frame when
    ``None``)."""

    def __init__(self, fp8=None, fp8_filter=None, model=None, prepared=None):
        from .fp8 import check_filter, check_recipe

        self.programs: list = []
        self.fp8 = check_recipe(fp8, "opfuse.optimize: fp8")
        self.fp8_filter = check_filter(fp8_filter, self.fp8, "opfuse.optimize: fp8_filter")
        self.model = model
        self.prepared = prepared

    def __deepcopy__(self, memo):
        # copy.deepcopy of a compiled model (an EMA or a frozen copy of it) copies Dynamo's wrappers
        # down to this backend: the copy gets a backend of its own, with the same settings, over
        # the copied model (``memo`` maps it and its packed parameters to the copies) and no
        # programs yet. The programs themselves hold fake tensors, which cannot be copied.
        import copy

        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for key, value in vars(self).items():
            setattr(twin, key, [] if key == "programs" else copy.deepcopy(value, memo))
        return twin

    def _record(self, program) -> None:
        if self.prepared is not None:
            program.notes.extend(("optimize", note) for note in self.prepared.notes)
        self.programs.append(program)

    def _settings(self, gm, example_inputs, options: dict, inductor: bool = True):
        from .fp8 import CompileSettings, check_filter, check_recipe
        from .inputs import describe_inputs

        recipe, fp8_filter = self.fp8, self.fp8_filter
        if "fp8" in options or "fp8_filter" in options:
            if recipe is not None:
                raise ValueError("opfuse backend: fp8 given both to opfuse.optimize and in options=; give it once")
            recipe = check_recipe(options.pop("fp8", None))
            fp8_filter = check_filter(options.pop("fp8_filter", None), recipe)
        inputs = describe_inputs(gm, example_inputs, [self.model] if self.model is not None else ())
        routers = self.prepared.routers if self.prepared is not None else set()
        return CompileSettings(fp8=recipe, fp8_filter=fp8_filter, inputs=inputs, routers=routers, inductor=inductor)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
        from .graph_pass import FusionPass, PassChain
        from .norm_epsilons import specialize_norm_epsilons

        options = dict(options or {})
        inductor = options.pop("inductor", True)
        if not isinstance(inductor, bool):
            raise TypeError(f"opfuse backend: options['inductor']={inductor!r}; expected True or False")
        specialize_norm_epsilons(gm)
        settings = self._settings(gm, example_inputs, options, inductor)
        fusion = FusionPass(self._record, settings)
        if not inductor:
            if mode not in (None, "default"):
                raise ValueError(f"opfuse backend: mode={mode!r} needs Inductor; drop options['inductor']=False")
            if options:
                raise ValueError(f"opfuse backend: Inductor options {sorted(options)} given with "
                                 f"options['inductor']=False")
            _fp8_without_graphs(settings, graphs=False)
            return _guarded(_aot_eager(gm, example_inputs, fusion), settings)
        from torch._inductor import config as inductor_config
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = dict(list_mode_options(mode)) if mode not in (None, "default") else {}
        patches.update(options)
        _no_async_tp_under_graphs(gm, patches, inductor_config, settings, example_inputs)
        settings.cuda_graphs = bool(patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs))
        _fp8_without_graphs(settings, graphs=settings.cuda_graphs)
        if "reorder_for_peak_memory" not in patches and _keeps_collective_order(gm, example_inputs):
            # Inductor's peak-memory reordering moves a collective's wait back before the GEMMs
            # that overlap.schedule_overlaps placed under it (measured: they then ran after it).
            patches["reorder_for_peak_memory"] = False
        existing = patches.get("joint_custom_post_pass", inductor_config.joint_custom_post_pass)
        patches["joint_custom_post_pass"] = fusion if existing is None else PassChain(existing, fusion)
        return _guarded(compile_fx(gm, example_inputs, config_patches=patches), settings)


def _guarded(compiled, settings):
    """``compiled``, checking before each call that the inputs its graphs join still lie where
    they did (:mod:`.layout_guard`)."""
    from .layout_guard import guard_layouts

    return guard_layouts(compiled, settings.joined, [i.name for i in settings.inputs])


def _fp8_without_graphs(settings, graphs: bool) -> None:
    """Say in ``explain()`` that an FP8 graph compiled without CUDA graphs launches its quantizations
    from the host: each FP8 GEMM adds an activation cast and a scaled GEMM (the weight casts of one
    shape share a launch), so a step of short GEMMs waits on the host (measured, one H200: 16 layers
    of hidden 2048, train-tp at 2048 tokens, 2.32x of torch.compile bf16's step without CUDA
    graphs, 0.93x with them; docs/PERF_NOTES.model.md, session 26)."""
    if settings.fp8 is None or graphs:
        return
    settings.notes.append("FP8 without CUDA graphs: every FP8 GEMM adds quantization kernels the host launches one "
                          "by one; where the GEMMs are short (hidden ~2048) the step waits on the host and can be "
                          "slower than bf16. Compile with mode='reduce-overhead' (CUDA graphs) there")


def _no_async_tp_under_graphs(gm: torch.fx.GraphModule, patches: dict, inductor_config, settings,
                              example_inputs=()) -> None:
    """Turn Inductor's micro-pipeline TP off for a graph compiled with CUDA graphs
    (``mode="reduce-overhead"``) that has collectives, saying so in ``explain()``: its fused
    matmul + collective ops allocate their symmetric-memory workspace on first use, which under a
    cudagraph tree is the warm-up, inside the graph's pool, and the tree then fails the graph
    ("tensor(s) in the cudagraph pool not tracked as outputs"; torch 2.11 measured, session 14).
    opfuse's own collective GEMMs keep their overlap: their memory is reserved when the graph is built."""
    graphs = patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    async_tp = patches.get("_micro_pipeline_tp", getattr(inductor_config, "_micro_pipeline_tp", False))
    if graphs and async_tp and _has_collectives(gm, example_inputs):
        patches["_micro_pipeline_tp"] = False
        settings.notes.append("Inductor's async TP (_micro_pipeline_tp) off for this graph: with CUDA graphs its "
                              "symmetric-memory workspace would be allocated in the graph's pool during the warm-up, "
                              "which the cudagraph tree refuses; opfuse's collective GEMMs overlap instead")


def _has_collectives(gm: torch.fx.GraphModule, example_inputs=()) -> bool:
    """Whether the graph (or an autograd.Function body in it) calls a collective, or computes on
    DTensors, whose collectives appear only when AOTAutograd lowers the subclass (Dynamo's graph of a
    sequence-parallel DTensor model has none)."""
    if _has_dtensors(gm, example_inputs):
        return True
    for module in gm.modules():  # autograd.Function bodies are subgraphs (backward all-reduces)
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            target = f"{getattr(node.target, '__module__', '')}.{getattr(node.target, '__name__', node.target)}"
            if node.op == "call_function" and any(key in target for key in _COLLECTIVE_NAMES):
                return True
    return False


def _has_dtensors(gm: torch.fx.GraphModule, example_inputs=()) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    if any(isinstance(value, DTensor) for value in example_inputs):
        return True
    return any(isinstance(node.meta.get("example_value"), DTensor) for node in gm.graph.nodes)


def _keeps_collective_order(gm: torch.fx.GraphModule, example_inputs=()) -> bool:
    """Whether this graph's collectives may be left to NCCL and scheduled under independent GEMMs
    (:mod:`.overlap`): the setting allows it and the graph has a collective at all."""
    from ..config import config

    return config.overlap_collectives == "auto" and _has_collectives(gm, example_inputs)


_COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather", "_c10d_functional", "distributed")


def _aot_eager(gm, example_inputs, fusion):
    """AOTAutograd with Inductor's decompositions and partitioner, graphs run by torch.fx."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    def fused(graph_module):
        remove_noop_ops(graph_module.graph)  # as Inductor's joint passes do before opfuse's
        fusion(graph_module.graph)
        graph_module.recompile()
        return graph_module

    def partition(joint, joint_inputs, **kwargs):
        return min_cut_rematerialization_partition(fused(joint), joint_inputs, compiler="inductor", **kwargs)

    def run(graph_module, _inputs):
        return make_boxed_func(graph_module.forward)

    def inference(graph_module, _inputs):
        return make_boxed_func(fused(graph_module).forward)

    return aot_autograd(fw_compiler=run, bw_compiler=run, inference_compiler=inference, partition_fn=partition,
                        decompositions=select_decomp_table())(gm, example_inputs)


#: The backend behind the name ``"opfuse"``.
DEFAULT_BACKEND = OpfuseBackend()
_OPTIMIZED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def opfuse_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The ``"opfuse"`` torch.compile backend (see the module docstring)."""
    return DEFAULT_BACKEND(gm, example_inputs, **kwargs)


def optimize(model, *, fp8=None, fp8_filter=None, merge_projections: bool = True, moe: bool = True,
             **compile_kwargs):
    """``torch.compile(model, backend=<a new opfuse backend>, **compile_kwargs)``, with static
    shapes unless ``dynamic=`` says otherwise (opfuse chooses implementations per shape).

    Returns the compiled model; after a call, :func:`programs` lists what opfuse did to each of
    its graphs. A model that is already a ``torch.compile`` result is refused (``TypeError``):
    compiling it again would nest two compilers, the inner one never seeing a graph.

    Parameters
    ----------
    fp8:
        An :mod:`opfuse.fp8` recipe (``opfuse.fp8.TensorScaling()``, ``RowwiseScaling()``): every
        recognised projection GEMM runs in FP8, forward and backward, with the quantization fused
        into the op that produces its input where a rule does so (see the README's FP8 section).
    fp8_filter:
        ``fn(fqn, module) -> bool``: ``False`` keeps that linear (e.g. the output head,
        ``lambda fqn, m: fqn != "output"``) in high precision. The routers of rewritten MoE
        blocks stay in high precision whatever it says.
    merge_projections:
        Store sibling projections (q/k/v, gate/up) back to back so that one GEMM reads them
        without a copy (:mod:`opfuse.torch_compile.merge_projections`: the parameters stay the
        same objects, ``state_dict`` is unchanged).
    moe:
        Rewrite Hugging Face style mixture-of-experts blocks (a loop over experts) into grouped
        GEMMs with the group sizes on the device (:mod:`opfuse.torch_compile.moe`).

    ``model``'s rewrites (``merge_projections``, ``moe``) are made here, in place, and listed by
    every program's ``explain()``; :func:`opfuse.torch_compile.prepare_model` makes them for
    ``torch.compile(model, backend="opfuse")``.

    Examples
    --------
    >>> fast = opfuse.optimize(model, mode="reduce-overhead")       # doctest: +SKIP
    >>> loss = fast(tokens).sum(); loss.backward()                  # doctest: +SKIP
    >>> for program in opfuse.programs(fast):                       # doctest: +SKIP
    ...     print(program.explain())
    >>> fp8 = opfuse.optimize(model, fp8=opfuse.fp8.TensorScaling(),
    ...                       fp8_filter=lambda fqn, module: fqn != "output")  # doctest: +SKIP
    """
    if "backend" in compile_kwargs:
        raise TypeError("opfuse.optimize: backend= is opfuse's; call torch.compile for another backend")
    if model is not None and not callable(model):
        raise TypeError(f"opfuse.optimize: model is a {type(model).__name__}; expected a torch.nn.Module or a function")
    if _is_compiled(model):
        # torch.compile of a compiled model nests two compilers: the outer one traces through the
        # inner one, whose backend never sees a graph (its programs stay empty).
        raise TypeError(f"opfuse.optimize: the model is already compiled ({type(model).__name__}, from "
                        f"opfuse.optimize or torch.compile); pass the original model (compiled._orig_mod for a "
                        f"module) or use the compiled one as it is")
    _check_compile_kwargs(compile_kwargs)
    compile_kwargs.setdefault("dynamic", False)
    module = model if isinstance(model, torch.nn.Module) else None
    prepared = None
    if module is not None:
        from .prepare import prepare_model

        prepared = prepare_model(module, merge_projections=merge_projections, moe=moe)
    backend = OpfuseBackend(fp8=fp8, fp8_filter=fp8_filter, model=module, prepared=prepared)
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    if prepared is not None and len(prepared.packed):
        # Parameters moved after this call (model.to(...)) are packed again before the next one.
        compiled.register_forward_pre_hook(prepared.packed.check_hook())
    _OPTIMIZED[compiled] = backend
    return compiled


#: ``torch.compile``'s keyword arguments that :func:`optimize` passes on (``backend`` is opfuse's).
_COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options", "disable")


def _check_compile_kwargs(kwargs: dict) -> None:
    """Refuse, when :func:`optimize` is called, what ``torch.compile`` would otherwise report only
    at the first call of the compiled model (wrapped in Dynamo's ``BackendCompilerFailed``) or in
    torch's own words: unknown arguments, wrong types, an unknown ``mode``, unknown ``options``."""
    from torch._inductor import list_mode_options, list_options

    unknown = sorted(set(kwargs) - set(_COMPILE_KWARGS))
    if unknown:
        raise TypeError(f"opfuse.optimize: unknown argument(s) {unknown}; accepted: fp8, fp8_filter, "
                        f"merge_projections, moe and torch.compile's {', '.join(_COMPILE_KWARGS)}")
    for name in ("fullgraph", "disable"):
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise TypeError(f"opfuse.optimize: {name}={kwargs[name]!r}; expected True or False")
    if not (kwargs.get("dynamic") is None or isinstance(kwargs["dynamic"], bool)):
        raise TypeError(f"opfuse.optimize: dynamic={kwargs['dynamic']!r}; expected None, True or False")
    mode = kwargs.get("mode")
    if mode is not None:
        if not isinstance(mode, str):
            raise TypeError(f"opfuse.optimize: mode={mode!r}; expected a string (e.g. 'reduce-overhead') or None")
        try:
            list_mode_options(mode)
        except RuntimeError as error:
            raise ValueError(f"opfuse.optimize: {error}") from None
    options = kwargs.get("options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise TypeError(f"opfuse.optimize: options={options!r}; expected a dict of Inductor settings "
                        f"(torch._inductor.list_options()) and opfuse's {', '.join(OPFUSE_OPTIONS)}")
    if "inductor" in options and not isinstance(options["inductor"], bool):
        raise TypeError(f"opfuse.optimize: options['inductor']={options['inductor']!r}; expected True or False")
    known = set(list_options())
    unknown = sorted(str(key) for key in options if key not in OPFUSE_OPTIONS and key not in known)
    if unknown:
        raise ValueError(f"opfuse.optimize: options {unknown} are neither opfuse's ({', '.join(OPFUSE_OPTIONS)}) "
                         f"nor Inductor settings (torch._inductor.list_options())")


def _is_compiled(model) -> bool:
    """``model`` is a ``torch.compile`` result (a module's ``OptimizedModule`` or a compiled function)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule) or getattr(model, "_torchdynamo_orig_callable", None) is not None


def _find_backend(compiled) -> OpfuseBackend | None:
    """The opfuse backend behind a ``torch.compile`` result, following the wrappers Dynamo keeps
    (``dynamo_ctx.callback`` -> ``_torchdynamo_orig_backend`` -> ``compiler_fn``; a compiled
    function holds its context in its closure; ``nn.Module.compile()`` leaves the compiled function
    on the module as ``_compiled_call_impl``)."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    seen = set()
    stack = [getattr(getattr(compiled, "dynamo_ctx", None), "callback", None), compiled]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen or len(seen) > 32:
            continue
        seen.add(id(item))
        if isinstance(item, OpfuseBackend):
            return item
        if item is opfuse_backend:
            return DEFAULT_BACKEND
        for attr in ("_torchdynamo_orig_backend", "compiler_fn", "__wrapped__", "_torchdynamo_orig_callable",
                     "_compiled_call_impl"):
            stack.append(getattr(item, attr, None))
        for cell in getattr(item, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(content, _TorchDynamoContext):
                stack.append(content.callback)
    return None


def programs(compiled=None) -> list:
    """What opfuse did to each graph of ``compiled`` (a result of :func:`optimize` or of
    ``torch.compile(..., backend="opfuse")``), in compile order: a list of
    :class:`~opfuse.torch_compile.program.GraphProgram`. Without an argument: every graph the
    ``"opfuse"`` backend name compiled in this process.

    Models compiled with the backend name share it: their programs are listed together (use
    :func:`optimize` for one list per model).

    Raises ``RuntimeError`` while nothing has been compiled: torch.compile compiles a graph on the
    first call, so an empty list before it would read as "opfuse found nothing to do".
    """
    if compiled is None:
        backend = DEFAULT_BACKEND
        what = "with backend='opfuse' in this process (models from opfuse.optimize: opfuse.programs(model))"
    else:
        try:
            backend = _OPTIMIZED.get(compiled)
        except TypeError:  # not weakly referenceable
            backend = None
        backend = backend or _find_backend(compiled)
        what = f"for this {type(compiled).__name__}"
    if backend is None:
        raise ValueError(f"opfuse.programs: {type(compiled).__name__} was not compiled by opfuse; use "
                         f"opfuse.optimize(model) or torch.compile(model, backend='opfuse')")
    if not backend.programs:
        raise RuntimeError(f"opfuse.programs: nothing compiled yet {what}: torch.compile compiles a graph when "
                           f"the model is first called; call it, then ask (if it was called, torch.compile captured "
                           f"no graph from it: see torch._dynamo.explain)")
    return list(backend.programs)


_registered = False


def register() -> None:
    """Make ``backend="opfuse"`` known to torch.compile when no installed entry point provides it
    (an entry point is loaded by name on first use; importing torch's compiler stack here would
    cost every ``import opfuse`` about a second)."""
    global _registered
    from importlib.metadata import entry_points

    if _registered or "opfuse" in entry_points(group="torch_dynamo_backends").names:
        return
    from torch._dynamo.backends.registry import register_backend

    register_backend(compiler_fn=opfuse_backend, name="opfuse")
    _registered = True
