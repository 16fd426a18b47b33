"""A deterministic, bounded fuzz of the binding's public surface on the CPU (fuzz_cases.py: the cases and their
rules). Each family runs in its own subprocess, so that a crash (a signal, an abort) or a hang fails the test and
names the case that caused it instead of ending the test run. Fixed seeds: the same cases on every run.

Families (fixed seeds; CASES gives their counts): MoE constructor keywords and forward against
KernelBackendMoE.torch (output, aux loss and every gradient; ExpertParallelMoE with one rank bit for bit); precision
"fp8" within FP8's error; the original's moe_TC_softmax_topk_layer against the torch backend and its
moe_general_routing_inputs against a float64 loop; moe_deepep / moe_permuted against it; the raw backward with corrupted
saved state (refused, or the true state's gradients bit for bit); gather_sum's indices. About 20 s in all on 2 cores.
SONICMOE_FUZZ_CASES=N runs N cases per family instead (a longer hunt)."""
import os
import subprocess
import sys

import pytest

import sonicmoe_cpp as sm

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"moe": 800, "fp8": 100, "topk_fn": 300, "general": 300, "dispatched": 300, "state": 400, "gather_sum": 300}


@pytest.mark.parametrize("family", sorted(CASES))
def test_fuzz(family):
    count = int(os.environ.get("SONICMOE_FUZZ_CASES", CASES[family]))
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(sm.__file__)))  # the sonicmoe_cpp the tests import
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, pkg_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_cases.py"), family, "0", str(count)], env=env,
                           capture_output=True, text=True, timeout=120 + count)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        last = [l for l in out.splitlines() if l.startswith("CASE")][-1:]
        pytest.fail(f"fuzz family {family}: hang at {last}")
    last = [l for l in p.stdout.splitlines() if l.startswith("CASE")][-1:]
    assert p.returncode == 0 and f"DONE {count}" in p.stdout, (
        f"fuzz family {family}: exit code {p.returncode} at {last} (rerun: python python/tests/fuzz_cases.py "
        f"{family} <seed> 1)\n{p.stderr[-4000:]}")
