"""Triton permute / unpermute against the torch path: forward and all gradients."""

import pytest
import torch

from moe.kernels import permute, unpermute

from .test_permute import routing

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, e, k, d", [(0, 3, 2, 8), (1, 1, 1, 40), (37, 5, 2, 40), (37, 64, 3, 24)])
def test_triton_matches_torch(t, e, k, d, dtype):
    idx, weights = routing(t, e, k, seed=t + e)
    idx, weights = idx.to(DEVICE), weights.to(DEVICE)
    x = torch.randn(t, d, device=DEVICE).to(dtype)
    outs, grads = {}, {}
    for backend in ("torch", "triton"):
        xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
        xs, info = permute(xg, idx, num_experts=e, backend=backend)
        y = xs * 1.5  # stands in for the experts
        out = unpermute(y, info, wg, backend=backend)
        (out.float() * torch.linspace(-1, 1, d, device=DEVICE)).sum().backward()
        outs[backend] = (xs.detach(), out.detach())
        grads[backend] = (xg.grad, wg.grad)
    assert torch.equal(outs["triton"][0], outs["torch"][0])  # the gather is exact
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["triton"][1].float(), outs["torch"][1].float(), rtol=tol, atol=tol)
    for got, want in zip(grads["triton"], grads["torch"], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_unknown_backend_raises():
    idx, _ = routing(4, 3, 1, 0)
    with pytest.raises(ValueError, match="backend"):
        permute(torch.randn(4, 8), idx, num_experts=3, backend="cuda")


def test_triton_permute_refuses_fp64():
    idx, _ = routing(4, 3, 1, 0)
    with pytest.raises(ValueError, match="float64"):
        permute(torch.randn(4, 8, dtype=torch.float64, device=DEVICE), idx.to(DEVICE), num_experts=3, backend="triton")


def test_triton_path_is_custom_ops_that_compile():
    """opcheck on the Triton permute ops; a fullgraph compile (a graph break raises) of the
    rows-given-info gather and the combine gives eager's gradients."""
    from torch import library as torch_library

    from moe.kernels import permute_rows, sort_slots

    idx, weights = routing(11, 4, 2, seed=3)
    info = sort_slots(idx.to(DEVICE), num_experts=4)
    x = torch.randn(11, 16, device=DEVICE)
    y = torch.randn(info.slot.shape[0], 16, device=DEVICE)
    w = weights.to(DEVICE)
    ops = torch.ops.moe
    # inputs that require grad, so opcheck runs the registered backwards too
    xg, yg, wg = (v.clone().requires_grad_() for v in (x, y, w))
    torch_library.opcheck(ops.triton_permute.default, (xg, info.token, info.row_of_slot, 2))
    torch_library.opcheck(ops.triton_unpermute.default, (yg, wg, info.row_of_slot, info.slot, info.token))

    def f(x_, w_):
        return unpermute(permute_rows(x_, info, backend="triton") * 1.5, info, w_, backend="triton").square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    leaves = [v.clone().requires_grad_() for v in (x, w)]
    compiled(*leaves).backward()
    eager = [v.clone().requires_grad_() for v in (x, w)]
    f(*eager).backward()
    for a, b in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
