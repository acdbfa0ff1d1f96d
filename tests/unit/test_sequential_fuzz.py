"""The Sequential front end's differential fuzzer, one process (world 1): random blocks of
Linear (unsharded / column / row), GatedLinear, SwiGLU, GELU, RMSNorm, LayerNorm, AddExtraInput
and MakeExtraOutput, fused and unfused, against the unsharded float64 math (forward and every
gradient), or the error that names the op placed where it cannot take its input
(``tests/sequential_blocks.py``). Seeds are fixed; ``tests/dist/test_sequential_fuzz.py`` runs
the same generator at world 2."""

import pytest

from ..sequential_blocks import generate, run_case

SEEDS = range(400)


@pytest.mark.parametrize("fuse", [True, False])
def test_random_blocks_match_the_unsharded_math_or_name_the_op(world1, fuse):
    outcomes = [run_case(generate(seed, 1), 0, 1, fuse=fuse) for seed in SEEDS]
    assert outcomes.count("refused") >= 60 and outcomes.count("ok") >= 250, outcomes
