"""The Sequential front end's differential fuzzer at world 2 (gloo): random tensor-parallel blocks
(column / row / unsharded Linear, GatedLinear, SwiGLU, GELU, RMSNorm, LayerNorm, extra inputs and
outputs; sequence parallel or not; fused and unfused) against the unsharded float64 math, forward
and every gradient, or the error naming the op placed where it cannot take its input
(``tests/sequential_blocks.py``). Seeds are fixed; one spawn runs them all."""

import pytest

from ..sequential_blocks import generate, run_case

SEEDS = range(150)


def fuzz(rank, world):
    outcomes = [run_case(generate(seed, world), rank, world, fuse=fuse) for seed in SEEDS for fuse in (True, False)]
    assert outcomes.count("refused") >= 20 and outcomes.count("ok") >= 200, outcomes


@pytest.mark.dist
def test_random_tensor_parallel_blocks_match_the_unsharded_math_or_name_the_op(session_spawn):
    session_spawn.run(fuzz, 2)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(fuzz, 2, ())]
