"""FSDP2 (fully_shard) and DDP over sonicmoe_cpp layers on GPUs with NCCL, one process a GPU: test_fsdp.py's cases
(MoE sharded on dim 0 with two micro-batches and an SGD step; ExpertParallelMoE with its experts split by EP and the
router under FSDP; MoE(precision="fp8") with its FP8 weight cache over two optimizer steps;
DistributedDataParallel(MoE); a MoE built on the meta device, sharded, then given memory and initialised) on CUDA
tensors, against the unsharded layer on the whole batch (the FP8 and DDP cases: on each rank's batch alone). World
size 1 on any GPU machine, 2 and 4 where that many GPUs are visible. fp32 parameters, computed in bf16 by the
kernels (as the binding does for fp32 CUDA inputs): the tolerance is bf16's."""
import pytest
import torch

import gloo_world
import test_fsdp

TOL = 2e-2  # bf16 compute on both sides: the rows of a rank's batch and the gradient sums are ordered differently
GPU_SHAPE = dict(dims=(16, 4, 512, 256), tokens=(700, 513, 256, 64), dev=None)  # dev: this rank's GPU


def _compute(rank, R):
    from torch.distributed.device_mesh import init_device_mesh
    shape = dict(GPU_SHAPE, dev=torch.device("cuda", rank))
    return test_fsdp.compute_cases(rank, R, init_device_mesh("cuda", (R,)), shape)


def _worker(rank, R, store_path, result_dir):
    gloo_world.worker(rank, R, store_path, result_dir, _compute, backend="nccl")


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(R):
    return gloo_world.run_world("test_fsdp_cuda", R, timeout_s=300, backend="nccl")


@pytest.mark.parametrize("R", [1, 2, 4])
def test_fully_shard_moe_on_gpus_matches_unsharded(R):
    for errs, info in test_fsdp.check_case(_run(R), R, "moe", TOL):
        assert info["dtensor"] and info["local_rows"] == GPU_SHAPE["dims"][0] // R
        assert {"out0", "out1", "x.grad0", "x.grad1", "c_fc.weight.grad", "router.weight.after_step"} <= set(errs)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_fully_shard_expert_parallel_on_gpus(R):
    for errs, info in test_fsdp.check_case(_run(R), R, "ep", TOL):
        assert info["router_dtensor"] and info["experts_plain"]
        assert {"out", "x.grad", "router.weight.grad", "c_proj.weight.grad"} <= set(errs)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_fully_shard_fp8_weight_cache_on_gpus(R):
    for errs, info in test_fsdp.check_case(_run(R), R, "fp8", TOL):
        assert {"out00", "out01", "out10", "out11", "c_fc.weight.grad1", "out_after_steps",
                "out_after_inplace"} <= set(errs)
        assert info == {"hits": 2, "misses": 4}, info  # test_fsdp.py's count: the optimizer steps and the in-place


@pytest.mark.parametrize("R", [1, 2, 4])
def test_distributed_data_parallel_on_gpus(R):
    for errs, _ in test_fsdp.check_case(_run(R), R, "ddp", TOL):
        assert {"out0", "out1", "x.grad0", "c_fc.weight.grad", "router.weight.after_step"} <= set(errs)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_fully_shard_of_a_meta_built_module_on_gpus(R):
    for errs, info in test_fsdp.check_case(_run(R), R, "meta_init", TOL):
        assert info["dtensor"] and info["biases_zero"] and {"out", "x.grad"} <= set(errs)
