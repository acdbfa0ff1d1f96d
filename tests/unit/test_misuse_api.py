"""Deliberate misuse and odd shapes of the public API, one process: each case is an error naming
the value and what is accepted (never a crash deep inside torch, never a value silently taken for
another), and odd shapes (0 or 1 tokens, hidden 1 or 7, non-contiguous inputs) that are accepted
give the float64 PyTorch reference's results. tests/unit/test_misuse_more.py has the earlier cases."""

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import fp8, ops, passes
from opfuse.config import reload_from_env
from opfuse.machinery.implementation import ImplementationError
from opfuse.passes import OpSpec, Pattern, PatternError, Replacement


@pytest.fixture(autouse=True)
def restore_settings():
    yield
    reload_from_env({})


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())


# opfuse.optimize -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"fp8": "tensor"}, TypeError, r"opfuse.optimize: fp8='tensor'; expected an opfuse.fp8 recipe"),
    ({"fp8": fp8.TensorScaling}, TypeError, r"opfuse.optimize: fp8=<class .*TensorScaling'>; expected an opfuse.fp8 "
                                            r"recipe: opfuse.fp8.TensorScaling\(\)"),
    ({"fp8": fp8.TensorScaling(), "fp8_filter": 3}, TypeError, r"fp8_filter=3; expected a function"),
    ({"fp8_filter": lambda fqn, m: True}, ValueError, r"fp8_filter given without an FP8 recipe"),
    ({"merge_projections": "yes"}, TypeError, r"merge_projections='yes'; expected True or False"),
    ({"moe": 1}, TypeError, r"moe=1; expected True or False"),
    ({"bogus": 1}, TypeError, r"unknown argument\(s\) \['bogus'\]; accepted: fp8, .* fullgraph, dynamic, mode"),
    ({"mode": "bogus"}, ValueError, r"opfuse.optimize: Unrecognized mode=bogus, should be one of: .*reduce-overhead"),
    ({"mode": 3}, TypeError, r"mode=3; expected a string"),
    ({"dynamic": "yes"}, TypeError, r"dynamic='yes'; expected None, True or False"),
    ({"fullgraph": 1}, TypeError, r"fullgraph=1; expected True or False"),
    ({"options": [1]}, TypeError, r"options=\[1\]; expected a dict of Inductor settings"),
    ({"options": {"inductor": "no"}}, TypeError, r"options\['inductor'\]='no'; expected True or False"),
    ({"options": {"unknown_key": 1}}, ValueError, r"options \['unknown_key'\] are neither opfuse's"),
], ids=["fp8-str", "fp8-class", "filter-not-callable", "filter-without-fp8", "merge-yes", "moe-int", "unknown-kwarg",
        "mode-unknown", "mode-int", "dynamic-str", "fullgraph-int", "options-list", "options-inductor-str",
        "options-unknown"])
def test_optimize_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        opfuse.optimize(_model(), **kwargs)


@pytest.mark.parametrize("model", [3, "model", 1.5])
def test_optimize_refuses_what_is_not_callable(model):
    with pytest.raises(TypeError, match=rf"opfuse.optimize: model is a {type(model).__name__}; expected a "
                                        r"torch.nn.Module or a function"):
        opfuse.optimize(model)


def test_sync_sequence_parallel_grads_of_what_is_not_a_module():
    with pytest.raises(TypeError, match=r"opfuse.sync_sequence_parallel_grads: module=3 \(int\); expected a "
                                        r"torch.nn.Module"):
        opfuse.sync_sequence_parallel_grads(3)


def test_optimize_twice_is_refused():
    compiled = opfuse.optimize(_model(), options={"inductor": False})
    with pytest.raises(TypeError, match=r"already compiled .*pass the original model"):
        opfuse.optimize(compiled)


# opfuse.config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, value, error, match", [
    ("fusee", True, AttributeError, r"opfuse.config has no setting 'fusee'; known: \["),
    ("fuse", "maybe", ValueError, r"opfuse.config.fuse='maybe': expected True or False"),
    ("symm_pool_mb", -1, ValueError, r"opfuse.config.symm_pool_mb=-1: expected an integer >= 1"),
    ("peer_timeout_ms", -5, ValueError, r"opfuse.config.peer_timeout_ms=-5: expected an integer >= 0"),
    ("allreduce_chunks", 2.0, ValueError, r"opfuse.config.allreduce_chunks=2.0: expected an integer >= 0"),
    ("disabled_rules", (1,), ValueError, r"disabled_rules=\(1,\): 1 is not a rule name"),
    ("force_impl", "op=impl=x", ValueError, r"'impl=x' is not an implementation name"),
    ("log", "verbose", ValueError, r"opfuse.config.log='verbose': expected one of 'warning', 'info', 'debug'"),
])
def test_config_assignment_names_the_value_and_what_is_accepted(name, value, error, match):
    before = getattr(opfuse.config, name, None)
    with pytest.raises(error, match=match):
        setattr(opfuse.config, name, value)
    assert getattr(opfuse.config, name, None) == before


def test_config_settings_cannot_be_deleted():
    """``del opfuse.config.fuse`` dropped the value that every later compile reads (a KeyError in
    snapshot(), far from the del)."""
    with pytest.raises(AttributeError, match=r"opfuse.config.fuse: settings cannot be deleted; assign a value"):
        del opfuse.config.fuse
    assert opfuse.config.fuse is True
    ops.Sequential(ops.RMSNorm(4))(torch.randn(2, 4))  # still compiles


def test_config_override_checks_names_and_values_and_restores():
    with pytest.raises(TypeError, match=r"opfuse.config.override: unknown setting\(s\) \['fusee'\]; known:"):
        with opfuse.config.override(fusee=False):
            pass
    with pytest.raises(ValueError, match=r"opfuse.config.fuse='x': expected True or False"):
        with opfuse.config.override(verify=False, fuse="x"):
            pass
    assert opfuse.config.verify is True and opfuse.config.fuse is True


@pytest.mark.parametrize("variable, text, match", [
    ("OPFUSE_ALLREDUCE_CHUNKS", "-1", r"OPFUSE_ALLREDUCE_CHUNKS='-1': expected an integer >= 0"),
    ("OPFUSE_ALLREDUCE_CHUNKS", "abc", r"OPFUSE_ALLREDUCE_CHUNKS='abc': expected an integer >= 0"),
    ("OPFUSE_PEER_TIMEOUT_MS", "-5", r"OPFUSE_PEER_TIMEOUT_MS='-5': expected an integer >= 0"),
    ("OPFUSE_FP8_WEIGHT_BATCH_MB", "-1", r"OPFUSE_FP8_WEIGHT_BATCH_MB='-1': expected an integer >= 0"),
    ("OPFUSE_FUSE", "maybe", r"OPFUSE_FUSE='maybe': expected True or False \(as text: 1/true/yes/on/0/false/no/off\)"),
    ("OPFUSE_FORCE_IMPL", "a=b=c", r"OPFUSE_FORCE_IMPL='a=b=c': 'b=c' is not an implementation name"),
])
def test_bad_environment_variables_are_refused_before_any_setting_changes(variable, text, match):
    opfuse.config.verify = False
    with pytest.raises(ValueError, match=match):
        reload_from_env({variable: text, "OPFUSE_VERIFY": "1"})
    assert opfuse.config.verify is False  # nothing applied


def test_misspelt_names_in_settings_are_refused_when_a_block_compiles():
    block = ops.Sequential(ops.Linear(4, 4), ops.AddExtraInput(), ops.RMSNorm(4))
    x = torch.randn(2, 4)
    cases = [({"disabled_rules": ("add_rmsnrom",)}, ValueError, r"unknown rule\(s\) \['add_rmsnrom'\]"),
             ({"disabled_passes": ("fusee",)}, passes.PassError, r"no pass named 'fusee' \(did you mean 'fuse'\?\)"),
             ({"force_impl": "nonexistent_op=foo"}, ImplementationError, r"unknown fused op 'nonexistent_op'"),
             ({"force_impl": "add_rmsnorm=foo"}, ImplementationError, r"fused op 'add_rmsnorm' has no implementation "
                                                                      r"'foo'")]
    for settings, error, match in cases:
        with opfuse.config.override(**settings):
            with pytest.raises(error, match=match):
                block(x, x)


# ops: constructors ------------------------------------------------------------------------------


@pytest.mark.parametrize("make, error, match", [
    (lambda: ops.Linear(0, 4), ValueError, r"Linear: in_features=0; expected a positive int"),
    (lambda: ops.Linear(4, -1), ValueError, r"Linear: out_features=-1; expected a positive int"),
    (lambda: ops.Linear(True, 4), ValueError, r"Linear: in_features=True; expected a positive int"),
    (lambda: ops.Linear(4.0, 4), ValueError, r"Linear: in_features=4.0; expected a positive int"),
    (lambda: ops.Linear(4, 4, parallel="bogus"), ValueError, r"Linear: parallel='bogus'; accepted: None, 'column', "
                                                             r"'row'"),
    (lambda: ops.Linear(4, 4, parallel="column", group="tp"), TypeError, r"Linear: group='tp' is a str; expected a "
                                                                         r"torch.distributed.ProcessGroup"),
    (lambda: ops.BasicLinear(-1, 4), ValueError, r"BasicLinear: in_features=-1; expected an int >= 0"),
    (lambda: ops.BasicLinear(4, 2.5), ValueError, r"BasicLinear: out_features=2.5; expected an int >= 0"),
    (lambda: ops.Bias(-1), ValueError, r"Bias: features=-1; expected an int >= 0"),
    (lambda: ops.RMSNorm(4, eps=-1e-6), ValueError, r"RMSNorm: eps=-1e-06; expected a finite float >= 0"),
    (lambda: ops.RMSNorm(4, eps=float("inf")), ValueError, r"RMSNorm: eps=inf; expected a finite float >= 0"),
    (lambda: ops.RMSNorm(4, eps=float("nan")), ValueError, r"RMSNorm: eps=nan; expected a finite float >= 0"),
    (lambda: ops.LayerNorm(4, eps=True), ValueError, r"LayerNorm: eps=True; expected a finite float >= 0"),
    (lambda: ops.RMSNorm(4, eps="1e-6"), ValueError, r"RMSNorm: eps='1e-6'; expected a finite float >= 0"),
    (lambda: ops.RMSNorm(True), ValueError, r"RMSNorm: normalized_shape=True; expected a positive int"),
    (lambda: ops.LayerNorm(0), ValueError, r"LayerNorm: normalized_shape=0; expected a positive int"),
    (lambda: ops.RMSNorm(4, elementwise_affine="no"), TypeError, r"RMSNorm: elementwise_affine='no'; expected True "
                                                                 r"or False"),
    (lambda: ops.LayerNorm(4, bias="no"), TypeError, r"LayerNorm: bias='no'; expected True or False"),
    (lambda: ops.Quantize("tensor"), ValueError, r"Quantize: dtype='tensor'; accepted: torch.float8_e4m3fn"),
    (lambda: ops.Quantize(rowwise="yes"), TypeError, r"Quantize: rowwise='yes'; expected True or False"),
    (lambda: ops.GELU(approximate="fast"), ValueError, r"GELU: approximate='fast'; accepted: 'none', 'tanh'"),
    (lambda: ops.GroupedLinear(True, 4, 4), ValueError, r"GroupedLinear: num_groups=True; expected a positive int"),
    (lambda: ops.Sequential(torch.nn.Linear(4, 4)), TypeError, r"Sequential: element 0 is a "
                                                               r"torch.nn.modules.linear.Linear; expected an opfuse op"),
    (lambda: ops.Sequential([ops.GELU()]), TypeError, r"Sequential: element 0 is a builtins.list; expected an opfuse "
                                                      r"op"),
])
def test_op_constructors_name_the_bad_value(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_sizes_given_as_integers_of_another_type_are_taken():
    import numpy as np

    linear = ops.Linear(np.int64(4), 3)
    assert linear.in_features == 4 and type(linear.in_features) is int
    assert ops.BasicLinear(0, 3).weight.shape == (3, 0)  # as torch.nn.Linear(0, 3): an empty GEMM


# ops.Sequential: calls --------------------------------------------------------------------------


def _residual_block(h=4):
    return ops.Sequential(ops.Linear(h, h), ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(h))


@pytest.mark.parametrize("inputs, match", [
    (lambda: (), r"Sequential: expected 2 input\(s\): x \(extra inputs for 1:AddExtraInput\); got 0"),
    (lambda: (torch.randn(2, 4),), r"Sequential: expected 2 input\(s\): x \(extra inputs for 1:AddExtraInput\); got 1"),
    (lambda: (torch.randn(2, 4), None), r"Sequential: input 1 is a NoneType; expected a torch.Tensor"),
    (lambda: ([[1.0] * 4], torch.randn(1, 4)), r"Sequential: input 0 is a list; expected a torch.Tensor"),
    (lambda: (torch.tensor(1.0), torch.tensor(1.0)), r"input must have at least 1 dim, got a scalar"),
    (lambda: (torch.randn(2, 5), torch.randn(2, 4)), r"input has 5 features \(last dim of shape \[2, 5\]\), "
                                                     r"expected 4"),
    (lambda: (torch.randn(2, 0), torch.randn(2, 4)), r"input has 0 features"),
    (lambda: (torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4)), r"input dtype float64 differs from the "
                                                                          r"parameter dtype float32"),
    (lambda: (torch.ones(2, 4, dtype=torch.int64), torch.randn(2, 4)), r"input has dtype int64, expected a floating "
                                                                       r"point dtype"),
    (lambda: (torch.randn(2, 4, device="meta"), torch.randn(2, 4)), r"input is on meta but the parameters are on "
                                                                    r"cpu"),
    (lambda: (torch.randn(2, 4), torch.randn(3, 4)), r"AddExtraInput: extra input has shape \[3, 4\], expected "
                                                     r"\[2, 4\]"),
    (lambda: (torch.randn(2, 4), torch.randn(4)), r"AddExtraInput: extra input has shape \[4\], expected \[2, 4\]"),
    (lambda: (torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64)), r"AddExtraInput: extra input has dtype "
                                                                          r"float64, expected float32"),
    (lambda: (torch.randn(2, 4), torch.randn(2, 4, device="meta")), r"AddExtraInput: extra input has device meta, "
                                                                    r"expected cpu"),
], ids=["none", "missing-extra", "extra-none", "list", "scalar", "last-dim", "zero-features", "dtype", "int-dtype",
        "device", "extra-shape", "extra-broadcast", "extra-dtype", "extra-device"])
def test_block_calls_with_bad_inputs_name_the_input(inputs, match):
    with pytest.raises(ops.OpInputError, match=match):
        _residual_block()(*inputs())


@pytest.mark.parametrize("block, match", [
    (lambda: ops.Sequential(), r"Sequential: the block has no ops"),
    (lambda: ops.Sequential(ops.Linear(4, 8), ops.Linear(4, 4)), r"Sequential op 1: .*input has 8 features .*expected 4"),
    (lambda: ops.Sequential(ops.Linear(4, 8), ops.RMSNorm(4)), r"Sequential op 1: RMSNorm\(4, eps=1e-06\): input has 8 "
                                                               r"features"),
    (lambda: ops.Sequential(ops.Linear(4, 3), ops.SwiGLU()), r"SwiGLU: input has 3 features .*expected an even "
                                                             r"number"),
])
def test_blocks_that_cannot_run_say_which_op(block, match):
    with pytest.raises(ops.OpInputError, match=match):
        block()(torch.randn(2, 4))


def test_group_misuse_at_world_1(world1):
    with pytest.raises(ops.PartitionError, match=r"Sequential op 1: RMSNorm.*sharded on features .*needs the full "
                                                 r"hidden dim"):
        ops.Sequential(ops.Linear(4, 4, parallel="column"), ops.RMSNorm(4))(torch.randn(2, 4))
    with pytest.raises(ops.PartitionError, match=r"use parallel='row' for a layer that follows a column-parallel one"):
        ops.Sequential(ops.Linear(4, 4, parallel="column"), ops.Linear(4, 4, parallel="column"))(torch.randn(2, 4))


# Odd shapes: the float64 reference --------------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("hidden", [1, 7])
@pytest.mark.parametrize("tokens", [0, 1, 5])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "3d"])
def test_odd_shapes_match_the_float64_reference(hidden, tokens, layout):
    torch.manual_seed(hidden * 10 + tokens)
    block = ops.Sequential(ops.Linear(hidden, hidden, dtype=torch.float64), ops.AddExtraInput(),
                           ops.MakeExtraOutput(), ops.RMSNorm(hidden, dtype=torch.float64),
                           ops.Linear(hidden, 3, dtype=torch.float64), ops.GELU(),
                           ops.Linear(3, hidden, dtype=torch.float64))
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))

    def make():
        if layout == "transposed":
            return torch.randn(hidden, tokens, dtype=torch.float64).t()
        if layout == "3d":
            return torch.randn(2, tokens, hidden, dtype=torch.float64)
        return torch.randn(tokens, hidden, dtype=torch.float64)

    x, residual = make(), make()
    xa, ra = x.clone().requires_grad_(), residual.clone().requires_grad_()
    y, new_residual = block(xa, ra)
    params = {k: v.detach().clone().requires_grad_() for k, v in block.named_parameters()}
    xb, rb = x.clone().requires_grad_(), residual.clone().requires_grad_()
    h = F.linear(xb, params["0.weight"], params["0.bias"]) + rb
    ref = F.linear(F.gelu(F.linear(_rms(h, params["3.weight"], 1e-6), params["4.weight"], params["4.bias"])),
                   params["6.weight"], params["6.bias"])
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(new_residual, h, rtol=1e-10, atol=1e-10)
    dy, dr = torch.randn_like(ref), torch.randn_like(h)
    torch.autograd.backward([y, new_residual], [dy, dr])
    torch.autograd.backward([ref, h], [dy, dr])
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ra.grad, rb.grad, rtol=1e-10, atol=1e-10)
    for name, p in block.named_parameters():
        expected = params[name].grad if params[name].grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(p), expected, rtol=1e-10,
                                   atol=1e-10, msg=name)


def test_grouped_linear_with_zero_tokens_and_bad_group_sizes():
    layer = ops.GroupedLinear(2, 4, 3)
    block = ops.Sequential(layer)
    assert block(torch.randn(0, 4), torch.tensor([0, 0])).shape == (0, 3)
    with pytest.raises(ValueError, match=r"group_sizes \[4, 3\] must be non-negative and sum to at most the 5 rows"):
        block(torch.randn(5, 4), torch.tensor([4, 3]))
    with pytest.raises(ValueError, match=r"group_sizes \[-1, 3\] must be non-negative"):
        block(torch.randn(5, 4), torch.tensor([-1, 3]))
    with pytest.raises(ops.OpInputError, match=r"group_sizes has dtype float32, expected int32 or int64"):
        block(torch.randn(5, 4), torch.tensor([2.0, 3.0]))
    with pytest.raises(ops.OpInputError, match=r"group_sizes has shape \[3\], expected \[2\]"):
        block(torch.randn(5, 4), torch.tensor([2, 3, 0]))


# FP8 recipes and autocast -----------------------------------------------------------------------


@pytest.mark.parametrize("make, error, match", [
    (lambda: fp8.TensorScaling(grad_dtype=torch.float32), ValueError, r"TensorScaling: grad_dtype=torch.float32; "
                                                                      r"accepted: torch.float8_e5m2, torch.float8_e4m3fn"),
    (lambda: fp8.RowwiseScaling(grad_dtype="e5m2"), ValueError, r"RowwiseScaling: grad_dtype='e5m2'; accepted:"),
    (lambda: fp8.TensorScaling(grad_dtype=[1]), ValueError, r"TensorScaling: grad_dtype=\[1\]; accepted:"),
    (lambda: fp8.TensorScaling(fp8_wgrad=1), ValueError, r"TensorScaling: fp8_wgrad=1; expected True or False"),
    (lambda: fp8.RowwiseScaling(pow2_weight_scales=True), ValueError, r"pow2_weight_scales=True; accepted with "
                                                                      r"TensorScaling only"),
    (lambda: fp8.Recipe(), TypeError, r"opfuse.fp8.Recipe is a base class"),
    (lambda: fp8.recipe_from_key(3), ValueError, r"opfuse.fp8: recipe key 3; expected a string such as"),
    (lambda: fp8.recipe_from_key("tensor/e4m3"), ValueError, r"recipe key 'tensor/e4m3'; expected e.g."),
], ids=["grad-float32", "grad-str", "grad-list", "wgrad-int", "pow2-row", "base", "key-int", "key-short"])
def test_recipe_misuse(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("kwargs, match", [
    ({"recipe": "tensor"}, r"opfuse.fp8.autocast: recipe='tensor'; expected opfuse.fp8.TensorScaling\(\)"),
    ({"recipe": fp8.TensorScaling}, r"opfuse.fp8.autocast: recipe=<class"),
    ({"enabled": "no"}, r"opfuse.fp8.autocast: enabled='no'; expected True or False"),
    ({"enabled": 0}, r"opfuse.fp8.autocast: enabled=0; expected True or False"),
    ({"frozen_weights": "no"}, r"opfuse.fp8.autocast: frozen_weights='no'; expected True or False"),
])
def test_autocast_misuse(kwargs, match):
    """``enabled="no"`` turned FP8 on (a truthy string)."""
    with pytest.raises(TypeError, match=match):
        with fp8.autocast(**kwargs):
            pass
    assert fp8.current_recipe() is None and not fp8.weights_frozen()


# Rule registration ------------------------------------------------------------------------------


class _Gelu(torch.nn.Module):
    def forward(self, x):
        return F.gelu(x)


def _build(match):
    return Replacement(_Gelu())


_GELU = Pattern.chain(OpSpec("act", "GELU"))


@pytest.fixture
def cleanup_rules():
    yield
    for name in ("misuse_api_rule", "misuse_api_other"):
        if name in {rule.name for rule in passes.rules()}:
            passes.remove_rule(name)


@pytest.mark.parametrize("kwargs, match", [
    ({"build": 3}, r"Rule 'misuse_api_other': build=3 is not callable"),
    ({"pattern": "GELU"}, r"pattern='GELU'; expected an opfuse.passes.Pattern"),
    ({"name": "my rule"}, r"Rule: name='my rule'; expected a non-empty identifier-like string"),
    ({"priority": "high"}, r"priority='high'; expected an int"),
    ({"where": [3]}, r"where= entries must be Predicates or callables, got 3"),
    ({"where": lambda match: True}, r"Rule 'misuse_api_other': where=.* is one predicate; expected a sequence of them"),
    ({"replace": "yes"}, r"register_rule: replace='yes'; expected True or False"),
    ({"where": "x"}, r"where='x'; expected a list or tuple of predicates"),
], ids=["build", "pattern", "name", "priority", "where-item", "where-single", "replace", "where-str"])
def test_register_rule_misuse(cleanup_rules, kwargs, match):
    arguments = {"name": "misuse_api_other", "pattern": _GELU, "build": _build, **kwargs}
    with pytest.raises(PatternError, match=match):
        passes.register_rule(**arguments)
    assert "misuse_api_other" not in {rule.name for rule in passes.rules()}


def test_register_rule_twice_and_replace(cleanup_rules):
    first = passes.register_rule(name="misuse_api_rule", pattern=_GELU, build=_build)
    assert "test_misuse_api.py" in first.source  # the user's line, not the API's
    with pytest.raises(PatternError, match=r"register_rule: a rule named 'misuse_api_rule' exists \(defined at "
                                           r".*test_misuse_api.py:\d+\); pass replace=True"):
        passes.register_rule(name="misuse_api_rule", pattern=_GELU, build=_build)
    with pytest.raises(PatternError, match=r"register_rule: replace='yes'; expected True or False"):
        passes.register_rule(name="misuse_api_rule", pattern=_GELU, build=_build, replace="yes")
    assert {rule.name: rule for rule in passes.rules()}["misuse_api_rule"] is first  # not silently replaced

    @passes.register_rule(name="misuse_api_rule", pattern=_GELU, replace=True)
    def second(match):
        return Replacement(_Gelu())

    assert {rule.name: rule for rule in passes.rules()}["misuse_api_rule"] is second
    assert "test_misuse_api.py" in second.source


@pytest.mark.parametrize("call, error, match", [
    (lambda: passes.remove_rule("no_such_rule"), KeyError, r"remove_rule: no rule named 'no_such_rule'; known:"),
    (lambda: passes.remove_rule(3), PatternError, r"remove_rule: 3 is not a rule name \(a str\)"),
    (lambda: passes.disabled_rules("no_such_rule").__enter__(), KeyError, r"disabled_rules: unknown rule\(s\) "
                                                                          r"\['no_such_rule'\]"),
    (lambda: passes.disabled_rules(["add_rmsnorm"]).__enter__(), PatternError, r"disabled_rules: \['add_rmsnorm'\] is "
                                                                               r"not a rule name \(a str\); pass names "
                                                                               r"as separate arguments"),
    (lambda: passes.remove_pass("no_such_pass"), passes.PassError, r"remove_pass: no pass named 'no_such_pass'"),
    (lambda: passes.remove_pass("fuse"), passes.PassError, r"'fuse' is a built-in pass; disable it"),
], ids=["remove-unknown", "remove-int", "disable-unknown", "disable-list", "remove-pass-unknown",
        "remove-pass-builtin"])
def test_removing_or_disabling_what_is_not_registered(call, error, match):
    before = [rule.name for rule in passes.rules()]
    with pytest.raises(error, match=match):
        call()
    assert [rule.name for rule in passes.rules()] == before


@pytest.mark.parametrize("make, error, match", [
    (lambda: passes.OpSpec("act", 3), PatternError, r"OpSpec 'act': kinds=3; expected op kind names"),
    (lambda: passes.OpSpec("act", "GELU", where=lambda m: True), PatternError,
     r"OpSpec 'act': where=.* is one predicate; expected a sequence of them"),
    (lambda: opfuse.unsharded_state_dict(3), TypeError,
     r"opfuse.unsharded_state_dict: module=3; expected a torch.nn.Module"),
], ids=["opspec-kinds-int", "opspec-where-single", "unsharded-not-module"])
def test_pattern_and_checkpoint_misuse(make, error, match):
    with pytest.raises(error, match=match):
        make()
