"""The built-in passes, in the order the pipeline runs them (:mod:`opfuse.core.pipeline`):
:mod:`.partition` (expand composite ops, insert collectives; :mod:`.fp8` marks FP8 GEMMs),
:mod:`.horizontal` (GEMMs reading one value as one GEMM), :mod:`.fuse` (the rules),
:mod:`.cleanup` (with :mod:`.fold`), :mod:`.select` (implementation choice), :mod:`.verify`.
"""
