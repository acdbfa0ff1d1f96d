"""The machinery the core and the families are built from; it knows no rule, no pass and no fused op.

Rules: :mod:`.pattern` (op kinds and predicates), :mod:`.rule` (a rule, its match and replacement),
:mod:`.matcher` (structural matching, legality, near misses), :mod:`.rewrite` (replacing a match),
:mod:`.predicates` (reusable predicates). Passes: :mod:`.graph_pass` (a named pass and where it runs),
:mod:`.context` (what a pass sees, the fusion records). Fused ops: :mod:`.fused_op` (the module and
its custom ops), :mod:`.implementation` (implementations, how one is chosen, a family's table),
:mod:`.family` (what a family declares). torch.compile: :mod:`.aten` (questions about aten nodes),
:mod:`.region` (aten nodes standing for one op).
"""
