"""The rank-agreement signatures of both front ends share one header (opfuse/core/agree.py): one line
per setting, then the rules, passes and implementations; the torch.compile backend's check finds
the groups of a graph's functional collectives and exchanges nothing for a group of one rank."""

import torch
import torch.distributed._functional_collectives as funcol
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import opfuse
from opfuse.core import agree as core
from opfuse.sequential import agree as sequential
from opfuse.torch_compile import agree as compile_agree
from opfuse.torch_compile.fp8 import CompileSettings


def test_both_front_ends_start_with_the_shared_header():
    header = core.settings_lines()
    assert header[0] == f"setting fuse={opfuse.config.fuse!r} (OPFUSE_FUSE)"
    assert [line.split("=")[0] for line in header[:len(core.SHARED_SETTINGS)]] == \
        [f"setting {name}" for name in core.SHARED_SETTINGS]
    assert [line.split(" ")[0] for line in header[len(core.SHARED_SETTINGS):]] == ["rules", "passes", "implementations"]
    empty = fx.GraphModule(torch.nn.Module(), fx.Graph())
    assert sequential.signature_lines(empty) == core.settings_lines(("check_replicated",))
    lines = compile_agree.signature_lines(CompileSettings())
    shared = core.settings_lines(compile_agree.COMPILE_SETTINGS)
    assert lines[:len(shared)] == shared
    assert [line.split(" ")[0] for line in lines[len(shared):]] == ["recognizers", "backend"]
    assert sequential.RankMismatchError is core.RankMismatchError


def test_a_setting_change_changes_its_own_line_only():
    before = compile_agree.signature_lines(CompileSettings())
    with opfuse.config.override(allreduce_chunks=3):
        after = compile_agree.signature_lines(CompileSettings())
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert changed == [("setting allreduce_chunks=1 (OPFUSE_ALLREDUCE_CHUNKS)",
                        "setting allreduce_chunks=3 (OPFUSE_ALLREDUCE_CHUNKS)")]
    fp8 = compile_agree.signature_lines(CompileSettings(fp8=opfuse.fp8.TensorScaling(), fp8_filter=lambda *_: True))
    assert fp8[-1] == f"backend fp8={opfuse.fp8.TensorScaling().key()} fp8_filter=given inductor=True"


def test_collective_groups_of_a_one_rank_group_exchange_nothing(world1, monkeypatch):
    gm = make_fx(lambda x: funcol.wait_tensor(funcol.all_reduce(x, "sum", world1)) * 2)(torch.randn(4))
    issues = [n for n in gm.graph.nodes if compile_agree.is_collective(n) and compile_agree._group_name(n)]
    assert [compile_agree._group_name(n) for n in issues] == [world1.group_name]
    assert compile_agree.collective_groups(gm) == []  # world size 1

    def refuse(self, *args, **kwargs):
        raise AssertionError("store traffic for a group of one rank")

    monkeypatch.setattr(compile_agree.CompileAgreement, "publish", refuse)
    compile_agree.check_ranks_agree(gm, CompileSettings())
