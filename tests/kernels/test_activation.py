"""swiglu against autograd on F.silu(gate) * up: forward and gradients, kept memory reused."""

import pytest
import torch
import torch.nn.functional as F

from moe.kernels import swiglu, workspace


def pair(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple((3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_() for _ in range(2))


def grads(fn, gate, up, da):
    gate.grad = up.grad = None
    out = fn(gate, up)
    out.backward(da)
    return out.detach().clone(), gate.grad.clone(), up.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 8), (37, 24), (600, 1000)])  # the last in kept memory
def test_matches_autograd(shape, dtype):
    workspace.release()
    for seed in range(2):  # the second call runs in the memory the first one left dirty
        gate, up = pair(shape, dtype, seed)
        da = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 10)).to(dtype)
        ours = grads(swiglu, gate, up, da)
        plain = grads(lambda g, u: F.silu(g) * u, gate, up, da)
        for a, b in zip(ours, plain, strict=True):
            assert a.dtype == dtype and a.shape == shape
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same elementwise ops, rounded alike
    if shape[0] == 600:
        assert workspace.kept_bytes() > 0


def test_without_grad_and_one_input_needing_grad():
    gate, up = pair((600, 1000), torch.float32, 0)
    with torch.no_grad():
        out = swiglu(gate, up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=0, atol=0)
    assert not out.requires_grad
    up_const = up.detach()
    swiglu(gate, up_const).sum().backward()
    gate2 = gate.detach().requires_grad_()
    (F.silu(gate2) * up_const).sum().backward()
    torch.testing.assert_close(gate.grad, gate2.grad, rtol=0, atol=0)


def test_retain_graph_and_higher_derivatives():
    gate, up = pair((37, 24), torch.float64, 0)
    out = swiglu(gate, up).sum()
    (g1,) = torch.autograd.grad(out, gate, retain_graph=True)
    (g2,) = torch.autograd.grad(out, gate)  # a second backward reads the saved tensors unchanged
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    small = (gate[:5, :4].detach().requires_grad_(), up[:5, :4].detach().requires_grad_())
    assert torch.autograd.gradcheck(swiglu, small) and torch.autograd.gradgradcheck(swiglu, small)


@pytest.mark.parametrize(
    "gate, up, match",
    [
        (torch.zeros(2, 3), torch.zeros(3, 2), "must match in shape"),
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64), "must match in shape, dtype"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), "floating"),
        (torch.zeros(2, 3), [0.0], "must be tensors"),
    ],
)
def test_bad_input_raises(gate, up, match):
    with pytest.raises(ValueError, match=match):
        swiglu(gate, up)


def test_compiles_without_graph_breaks():
    gate, up = pair((37, 24), torch.float32, 0)
    compiled = torch.compile(lambda g, u: swiglu(g, u).square().sum(), backend="aot_eager", fullgraph=True)
    compiled(gate, up).backward()
    g2, u2 = gate.detach().requires_grad_(), up.detach().requires_grad_()
    (F.silu(g2) * u2).square().sum().backward()
    torch.testing.assert_close(gate.grad, g2.grad)
    torch.testing.assert_close(up.grad, u2.grad)


def test_create_graph_gives_autograds_results_and_torch_func_works():
    gate, up = pair((600, 1000), torch.bfloat16, 0)  # in kept memory
    da = torch.randn(600, 1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ours = torch.autograd.grad(swiglu(gate, up), (gate, up), da, create_graph=True)
    plain = torch.autograd.grad(F.silu(gate) * up, (gate, up), da, create_graph=True)
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    g64, u64 = (t.detach()[:6, :5].double() for t in (gate, up))
    per_row = torch.func.vmap(torch.func.grad(lambda g, u: swiglu(g, u).sum()))(g64, u64)
    torch.testing.assert_close(per_row, torch.func.vmap(torch.func.grad(lambda g, u: (F.silu(g) * u).sum()))(g64, u64))
    jac = torch.func.jacrev(swiglu)(g64, u64)
    torch.testing.assert_close(jac, torch.func.jacrev(lambda g, u: F.silu(g) * u)(g64, u64))


def test_forward_mode_ad():
    import torch.autograd.forward_ad as fwad

    g, u, tg, tu = (
        torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(4)
    )
    with fwad.dual_level():
        tangent = fwad.unpack_dual(swiglu(fwad.make_dual(g, tg), fwad.make_dual(u, tu))).tangent
    _, expect = torch.func.jvp(lambda g_, u_: F.silu(g_) * u_, (g, u), (tg, tu))
    torch.testing.assert_close(tangent, expect)
