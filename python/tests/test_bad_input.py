"""Bad input through the binding, as a new user tries it (CPU; the GPU cases are in test_cuda_full_size.py): every
case is an exception that names the problem, never a crash, never a silently wrong result."""
import pytest
import torch

import sonicmoe_cpp as sm
from sonicmoe_cpp import _ops

E, H, I, K, T = 4, 16, 8, 2, 10


def module():
    torch.manual_seed(0)
    return sm.MoE(E, K, H, I, "swiglu", False, 0.3)


def raw_state(m, x):
    outs = torch.ops.sonicmoe.forward(x, m.router.weight, m.c_fc.weight, None, m.c_proj.weight, None, "swiglu", K,
                                      "topk", 128, None, None, None)
    return outs


# The saved state's names, in the ops' order (the schema's).
STATE_NAMES = _ops._STATE_NAMES


def raw_backward(m, x, outs, **over):
    state = dict(zip(STATE_NAMES, outs[2:]))
    state.update(over)
    return torch.ops.sonicmoe.backward(torch.ones_like(x), x, m.router.weight, m.c_fc.weight, None, m.c_proj.weight,
                                       None, "swiglu", K, "topk", *state.values(), None)


@pytest.mark.parametrize("routing", ["topk", "round_nearest", "round_up"])
def test_raw_backward_accepts_its_own_state(routing):
    """The validation passes every state the forward makes (token rounding included) and changes nothing: the
    gradients equal those of the unvalidated call."""
    m, x = module(), torch.randn(T, H)
    args = (x, m.router.weight, m.c_fc.weight, None, m.c_proj.weight, None, "swiglu", K, routing)
    with torch.no_grad():
        outs = torch.ops.sonicmoe.forward(*args, 4, None, None, None)
        grads = [torch.ops.sonicmoe.backward(torch.ones_like(x), *args, *outs[2:], None, False, check)
                 for check in (True, False)]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert torch.isfinite(grads[0][0]).all() and grads[0][0].abs().sum() > 0


@pytest.mark.parametrize("field,index,value", [("rev", 3, 10 ** 6), ("pair", 0, -1), ("gather", 5, T),
                                               ("offsets", 2, 1000), ("counts", 1, -3), ("topk_expert", 0, E),
                                               ("token_offsets", 4, -7)])
def test_raw_backward_rejects_inconsistent_state(field, index, value):
    m, x = module(), torch.randn(T, H)
    with torch.no_grad():
        outs = list(raw_state(m, x))
        t = outs[2 + STATE_NAMES.index(field)].clone()
        t.view(-1)[index] = value
        with pytest.raises((ValueError, RuntimeError), match="saved state"):
            raw_backward(m, x, outs, **{field: t})


def test_raw_backward_rejects_wrong_state_shape():
    m, x = module(), torch.randn(T, H)
    with torch.no_grad():
        outs = raw_state(m, x)
        with pytest.raises((ValueError, RuntimeError), match="'z'"):
            raw_backward(m, x, outs, z=outs[2][:-1].contiguous())


def test_double_backward_raises():
    m = module()
    x = torch.randn(T, H, requires_grad=True)
    out, _ = m(x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


def test_meta_mixed_with_cpu_raises():
    m = module()
    x = torch.randn(T, H)
    with pytest.raises((ValueError, RuntimeError), match="one device"):
        torch.ops.sonicmoe.forward(x, m.router.weight.detach().to("meta"), m.c_fc.weight.detach(), None,
                                   m.c_proj.weight.detach(), None, "swiglu", K, "topk", 128, None, None, None)
    with pytest.raises((ValueError, RuntimeError), match="one device"):
        torch.ops.sonicmoe.forward(x.to("meta"), m.router.weight.detach(), m.c_fc.weight.detach(), None,
                                   m.c_proj.weight.detach(), None, "swiglu", K, "topk", 128, None, None, None)


@pytest.mark.parametrize("kw", [dict(num_experts_per_tok=2.7), dict(tile=2.9), dict(hidden_size="16"),
                                dict(num_experts=True)])
def test_non_integer_sizes_raise(kw):
    args = dict(num_experts=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    args.update(kw)
    with pytest.raises(TypeError, match=list(kw)[0]):
        sm.MoE(**args)


def test_inference_mode_and_backend_keyword():
    m = module()
    x = torch.randn(3, 4, H)
    out, aux = m(x, kernel_backend_moe=sm.KernelBackendMoE.sonicmoe, is_inference_mode=True)
    with torch.no_grad():
        ref, ref_aux = m(x)
    assert aux is None and ref_aux is not None
    assert out.shape == x.shape and torch.equal(out, ref)
    assert not out.requires_grad
    with pytest.raises(ValueError, match="kernel_backend_moe"):
        m(x, kernel_backend_moe="tpu")


def test_activation_from_the_originals_enum():
    """The original's ActivationType is a plain Enum (not a str): its members are accepted by value."""
    from enum import Enum

    class OrigAct(Enum):
        SWIGLU = "swiglu"
        TANH = "tanh"

    assert sm.MoE(E, K, H, I, OrigAct.SWIGLU).activation_function == sm.ActivationType.SWIGLU
    with pytest.raises(ValueError, match="activation_function"):
        sm.MoE(E, K, H, I, OrigAct.TANH)


def test_raw_backward_checks_the_capacity_state():
    """Under a capacity the state carries demand and dropped: the validation accepts the forward's own and refuses a
    dropped count that disagrees with the pairs that have no row."""
    m, x = module(), torch.randn(T, H)
    with torch.no_grad():
        outs = torch.ops.sonicmoe.forward(x, m.router.weight, m.c_fc.weight, None, m.c_proj.weight, None, "swiglu", K,
                                          "topk", 128, None, None, None, capacity_factor=0.5)
        state = dict(zip(STATE_NAMES, outs[2:]))
        assert state["dropped"].shape == (1,) and int(state["dropped"]) > 0 and state["demand"].shape == (E,)
        assert (state["rev"] == -1).sum() == state["dropped"].sum()
        raw_backward(m, x, outs)  # its own state passes
        with pytest.raises((ValueError, RuntimeError), match="saved state 'dropped'"):
            raw_backward(m, x, outs, dropped=state["dropped"] + 1)
