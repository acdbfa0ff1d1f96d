"""Attention at decode over a key/value cache shared by groups of query heads (grouped-query
attention): the fused op ``decode_attention`` (one query position per sequence; each key/value
head read once for its whole group), its reference (SDPA over the folded queries) and Triton
kernels split over the cache's positions. The torch.compile front end writes it where a model
repeats its key/value heads before the attention (``torch_compile/grouped_attention.py``)."""

from ...machinery.family import Family
from .implementations import TABLE
from .op import DecodeAttention  # noqa: F401  (defines the fused op and its custom op opfuse::decode_attention)

FAMILY = Family('attention', TABLE)
