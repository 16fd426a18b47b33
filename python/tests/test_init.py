"""Building sonicmoe_cpp's modules as PyTorch models are built: nn.Linear's factory keywords (device, dtype), and
under torch.device("meta") (no memory; FSDP2 / torchtitan build large models so) followed by to_empty and
reset_parameters, which must give the constructor's initialisation and a working layer."""
import copy

import pytest
import torch

import sonicmoe_cpp as sm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and sm.built_with_cuda() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["interleaved", "separate"])
def test_factory_keywords(device, layout):
    """MoE(..., device=, dtype=) as nn.Linear's factory keywords: every parameter (and the router's correction bias,
    float32) made there; the layer runs on an input of that dtype."""
    m = sm.MoE(8, 2, 64, 32, add_bias=True, w1_layout=layout, scoring_func="sigmoid", e_score_correction_bias=True,
               device=device,
               dtype=torch.bfloat16)
    for n, p in m.named_parameters():
        assert p.device.type == device and p.dtype == torch.bfloat16, n
    assert m.router.e_score_correction_bias.dtype == torch.float32
    assert m.router.e_score_correction_bias.device.type == device
    y, aux = m(torch.randn(9, 64, device=device, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all() and y.abs().sum() > 0
    ep = sm.ExpertParallelMoE(8, 2, 64, 32, device=device, dtype=torch.float16)
    assert all(p.device.type == device and p.dtype == torch.float16 for p in ep.parameters())
    with pytest.raises(ValueError, match="argument 'dtype'"):
        sm.MoE(8, 2, 64, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="argument 'dtype'"):
        sm.ExpertParallelMoE(8, 2, 64, 32, dtype=torch.int32)


@pytest.mark.parametrize("layout", ["interleaved", "separate"])
def test_meta_device_init_then_to_empty_and_reset(layout):
    """Built under torch.device("meta") (no memory, as FSDP2 / torchtitan build large models), given memory by
    to_empty and initialised by reset_parameters: the constructor's initialisation (router and experts normal(0,
    std), biases zero), a working layer, and for the separate layout the gate / up pair read in place again."""
    with torch.device("meta"):
        m = sm.MoE(16, 2, 256, 128, add_bias=True, std=0.1, w1_layout=layout, scoring_func="sigmoid",
                   e_score_correction_bias=True)
    assert all(p.is_meta for p in m.parameters())
    m = m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()
    for n, p in m.named_parameters():
        if "bias" in n:
            assert torch.equal(p, torch.zeros_like(p)), n
        else:
            assert abs(p.std().item() - 0.1) < 0.01 and abs(p.mean().item()) < 0.01, n
    assert torch.equal(m.router.e_score_correction_bias, torch.zeros(16))
    if layout == "separate":
        assert sm.w1_separate.addresses_ok(m.c_fc.gate_weight, m.c_fc.up_weight)
    ref = copy.deepcopy(m)
    x = torch.randn(20, 256)
    y, aux = m(x)
    y_t, _ = ref(x, kernel_backend_moe=sm.KernelBackendMoE.torch)
    assert ((y - y_t).norm() / y_t.norm()).item() < 1e-5
    ep = sm.ExpertParallelMoE(8, 2, 64, 32, std=0.05, device="meta")
    ep = ep.to_empty(device="cpu")
    ep.reset_parameters()
    assert abs(ep.c_fc.weight.std().item() - 0.05) < 0.01 and torch.isfinite(ep(torch.randn(5, 64))[0]).all()
