"""The FP8 quantizer kernels compile for sm90 (Hopper) on a host without a GPU: Triton's own
compiler and its bundled ptxas, ahead of time, with the argument types the launchers pass. The
interpreter tests (tests/unit/test_quantize_triton_interpreter.py) check what the kernels compute;
this checks that the GPU compiler accepts them (loops with device-side bounds, layouts the
transposed stores need), so a kernel change cannot break every FP8 path before a GPU run sees it.
Needs triton (skipped otherwise, e.g. on CI)."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from opfuse.families.quantize import triton_kernels as kernels  # noqa: E402

PTR = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv"}
CAST = {"FMAX": 448.0, "WRITE_T": True, "BM": 32, "BN": 256}

CASES = {
    "amax_kernel": ({"x_ptr": "*bf16", "out_ptr": "*fp32", "valid_ptr": "*i64", "rows": "i32", "cols": "i32",
                     "stride": "i32", "group_stride": "i32"}, {"HAS_VALID": True, "BM": 32, "BN": 256}),
    "cast_kernel": ({**PTR, "amax_ptr": "*fp32", "scale_inv_ptr": "*fp32", "rows": "i32", "cols": "i32",
                     "stride": "i32", "group_stride": "i32"}, CAST),
    **{f"{kernel}{suffix}": (types, {**CAST, "TABLE": table}) for suffix, table in (("", False), ("_table", True))
       for kernel, types in (
        ("pow2_hinted_cast_kernel", {**PTR, "table_ptr": "*i64", "hint_ptr": "*i32", "scratch_ptr": "*fp32",
                                     "rows": "i32", "cols": "i32", "stride": "i32", "group_stride": "i32"}),
        ("pow2_fixup_kernel", {**PTR, "table_ptr": "*i64", "hint_ptr": "*i32", "scratch_ptr": "*fp32",
                               "scale_inv_ptr": "*fp32", "rows": "i32", "cols": "i32", "stride": "i32",
                               "group_stride": "i32", "tiles_n": "i32", "tiles": "i32", "programs": "i32"}))},
    "rowwise_kernel": ({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_inv_ptr": "*fp32", "amax_ptr": "*fp32",
                        "cols": "i32", "stride": "i32"},
                       {"FMAX": 448.0, "GIVEN_AMAX": False, "BN": 16384, "ONE_READ": True}),
    "rowwise_kernel_two_reads": ({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_inv_ptr": "*fp32",
                                  "amax_ptr": "*fp32", "cols": "i32", "stride": "i32"},
                                 {"FMAX": 448.0, "GIVEN_AMAX": True, "BN": 1024, "ONE_READ": False}),
    "group_column_amax_kernel": ({"x_ptr": "*bf16", "ends_ptr": "*i32", "amax_ptr": "*fp32", "cols": "i32",
                                  "stride": "i32"}, {"SLICES": 8, "BT": 64, "BC": 128}),
    "group_column_cast_kernel": ({"x_ptr": "*bf16", "ends_ptr": "*i32", "padded_ends_ptr": "*i32",
                                  "scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "groups": "i32", "cols": "i32",
                                  "stride": "i32", "padded_tokens": "i32"},
                                 {"FMAX": 448.0, "BT": 64, "BC": 128, "GP": 16}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantizer_kernel_compiles_for_sm90(name):
    fn = getattr(kernels, name.removesuffix("_two_reads").removesuffix("_table"))
    types, constexprs = CASES[name]
    params = fn.arg_names
    signature = {p: types[p] if p in types else "constexpr" for p in params}
    assert set(signature) - set(types) == set(constexprs), f"{name}: arguments {params}"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert len(compiled.asm["cubin"]) > 0
