"""Runs a test module's `_worker(rank, R, store_path, result_dir)` in R processes (gloo on the CPU, or NCCL with one
GPU a rank) and collects the JSON each rank writes to result_dir/rank{r}.json (test_ep.py, test_fsdp.py,
test_ep_cuda.py). The ranks are plain `python -c` subprocesses (not
multiprocessing's spawn, which re-imports the parent's __main__ and so depends on how pytest was launched); the
first that fails ends the others, and its log is the failure message. Results are cached per (module, R)."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

_RESULTS = {}


def run_world(module, R, timeout_s=180, backend="gloo"):
    """{rank: results} from R processes running `module._worker` (which joins the group with `backend`); a failed run
    fails every test that asks for it (reported again, not rerun)."""
    key = (module, R)
    if key in _RESULTS:
        if isinstance(_RESULTS[key], str):
            pytest.fail(_RESULTS[key])
        return _RESULTS[key]
    import torch.distributed as dist
    if not dist.is_available() or not getattr(dist, f"is_{backend}_available")():
        pytest.skip(f"torch.distributed with the {backend} backend is not available")
    if backend == "nccl":
        import torch
        if torch.cuda.device_count() < R:
            pytest.skip(f"NCCL world size {R} needs {R} GPUs, {torch.cuda.device_count()} visible")
    import sonicmoe_cpp as sm
    here = os.path.dirname(os.path.abspath(__file__))
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(sm.__file__)))  # the sonicmoe_cpp the tests import
    env = dict(os.environ, OMP_NUM_THREADS="1",  # R processes on a few cores: one OpenMP thread each
               PYTHONPATH=os.pathsep.join([here, pkg_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    code = f"import sys, {module}; {module}._worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])"
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        logs = [open(os.path.join(d, f"log{r}.txt"), "w+") for r in range(R)]
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(R), store, d], env=env, cwd=d,
                                  stdout=logs[r], stderr=subprocess.STDOUT) for r in range(R)]
        deadline = time.monotonic() + timeout_s
        failed = None
        try:
            while any(p.poll() is None for p in procs):
                failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if failed is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if failed is None:
                failed = next((r for r, p in enumerate(procs) if p.poll() != 0), None)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        try:
            if failed is not None:
                logs[failed].seek(0)
                _RESULTS[key] = (f"{module} R={R}: rank {failed} exited with {procs[failed].returncode}:\n"
                                 f"{logs[failed].read()[-6000:]}")
                pytest.fail(_RESULTS[key])
        finally:
            for f in logs:
                f.close()
        res = {}
        for r in range(R):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                res[r] = json.load(f)
    _RESULTS[key] = res
    return res


def worker(rank, R, store_path, result_dir, compute, backend="gloo"):
    """A rank's whole life: joins the group (file store; with NCCL, on GPU `rank`), writes compute(rank, R) as result_dir/rank{rank}.json,
    and leaves through finish_worker. On an exception it prints the traceback and exits 1 at once: the other ranks
    wait in a collective, and the parent ends them."""
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=R,
                            timeout=timedelta(seconds=120))
    try:
        results = compute(rank, R)
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    finish_worker()


def finish_worker():
    """End of a worker whose results are written: torch 2.11 + gloo sometimes aborts at exit when the group is
    destroyed without a barrier, and gloo's teardown has aborted processes after all the work succeeded ("terminate
    called without an active exception"), so: barrier, destroy, and leave without the interpreter's teardown."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
