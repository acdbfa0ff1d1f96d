"""The core both front ends call: the pass pipeline (:mod:`.pipeline`, with the built-in passes in
:mod:`.passes`), the process-wide rule registry (:mod:`.rules`), the dispatch table
(:mod:`.dispatch`), ``Program`` (:mod:`.program`: fusions, dumps, explain), what a compile records
(:mod:`.recorder`) and ``explain()`` (:mod:`.explain`).

The registries and the table are built by iterating the one list of families
(:data:`opfuse.families.FAMILIES`); nothing here imports a front end.
"""
