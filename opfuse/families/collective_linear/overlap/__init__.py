"""The overlap plans the ``p2p_overlap`` implementation runs, in the order a call goes through them:
:mod:`.planner` (what a call runs: schedule, channels, regions), :mod:`.policy` (grids and sizes,
pure Python), :mod:`.plan` (the instruction set of per-rank plans), :mod:`.schedules` (the
schedules as plan builders), :mod:`.resources` (pools, contexts, region names), :mod:`.executor`
(a plan compiled to straight-line Python on CUDA), :mod:`.simulate` (a CPU interpreter of plans the
tests use) and :mod:`.cpu_binding` (plans bound to CPU stand-ins, for tests and host-cost benches).
"""
