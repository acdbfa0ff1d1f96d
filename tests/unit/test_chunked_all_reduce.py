"""How many chunks the row-parallel GEMM + all-reduce split takes (opfuse/torch_compile/
chunked_all_reduce.py): ``auto`` only where every chunk keeps at least 2048 tokens (measured to win
there, to lose with chunks of 1024), at most 4; ``1`` never; ``n`` chunks up to one per token; a
negative setting is refused by name. The split itself is checked at world 2 and 4 in
tests/dist/test_compile_chunked_all_reduce.py."""

import pytest

from opfuse import config
from opfuse.torch_compile.chunked_all_reduce import CHUNK_ROWS, MAX_CHUNKS, chunk_count


@pytest.mark.parametrize("rows, setting, want", [
    (2048, 0, 1), (4095, 0, 1), (4096, 0, 2), (8192, 0, 4), (65536, 0, MAX_CHUNKS), (1, 0, 0),
    (8192, 1, 1), (12, 5, 5), (3, 5, 3), (4096, 2, 2),
])
def test_chunk_count(rows, setting, want):
    assert chunk_count(rows, setting) == want
    if setting == 0 and want >= 2:
        assert rows // want >= CHUNK_ROWS


def test_a_negative_chunk_setting_is_refused_with_its_value():
    with pytest.raises(ValueError, match="OPFUSE_ALLREDUCE_CHUNKS=-1"):
        chunk_count(100, -1)
    with pytest.raises(Exception, match="allreduce_chunks"):
        with config.override(allreduce_chunks=-2):
            pass
