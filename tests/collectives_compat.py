"""The tensor collectives of ``torch.distributed._functional_collectives`` under the names of the
torch that runs the tests (2.13 renamed them, and the old names warn there; 2.11 has only the old)."""

import torch.distributed._functional_collectives as funcol

all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
