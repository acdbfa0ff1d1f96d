"""tools/compile_time.py: both compilers timed in fresh processes and one summary line with the
ratio (a 1-layer model at world 1 on the CPU host)."""

import os
import re
import subprocess
import sys

from .tools_support import ROOT


def test_compile_time_reports_both_compilers_and_their_ratio():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "tools/compile_time.py", "--layers", "1", "--world", "1", "--dim", "32",
                          "--tokens", "8", "--rounds", "1", "--port", "29583"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rounds = re.findall(r"^round (\d): (compile|opfuse) ([0-9.]+) s$", run.stdout, re.M)
    # one round (each compile from empty caches takes ~20 s here): torch.compile first, then opfuse
    assert [(r, c) for r, c, _ in rounds] == [("0", "compile"), ("0", "opfuse")]
    summary = re.search(r"torch\.compile ([0-9.]+) s, opfuse ([0-9.]+) s \(medians of 1\): opfuse / torch\.compile "
                        r"([0-9.]+)$", run.stdout, re.M)
    assert summary, run.stdout
    compile_s, opfuse_s, ratio = map(float, summary.groups())
    assert compile_s > 0 and opfuse_s > 0 and abs(ratio - opfuse_s / compile_s) < 0.01
