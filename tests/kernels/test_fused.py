"""The fused permutation + grouped GEMM ops against the unfused composition: forward and every
gradient (x, w, gates), for the torch backend and the Triton kernels (interpreter on CPU), with
dropped slots, empty experts, T = 0 and awkward widths; gradcheck, opcheck and torch.compile."""

import pytest
import torch
from torch import library as torch_library

from moe.kernels import gather_grouped_mm, grouped_mm, grouped_mm_ref, grouped_mm_scatter, permute, unpermute

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routing(t: int, k: int, e: int, seed: int = 0) -> torch.Tensor:
    """(T, K) distinct experts per token; expert 1 receives nothing (when E > 2), one slot dropped."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(e, generator=g)[:k] for _ in range(t)]
    idx = torch.stack(rows) if t else torch.zeros(0, k, dtype=torch.int64)
    if e > 2:
        idx[idx == 1] = -1
    if t:
        idx[0, -1] = -1
    return idx


def run_both(t, k, e, i, n, dtype, backend, trans_w, seed=0):
    """(fused outputs and grads, unfused fp32 reference outputs and grads)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, i, generator=g)
    w1 = torch.randn(e, n, i, generator=g) if trans_w else torch.randn(e, i, n, generator=g)
    w2 = torch.randn(e, n, i, generator=g)
    gates = torch.rand(t, k, generator=g)
    idx = routing(t, k, e, seed)
    ds = torch.randn(t, i, generator=g)
    results = []
    for fused in (True, False):
        cast = dtype if fused else torch.float32
        # fresh leaves per run: .to() alone would hand back the same tensor and share its .grad
        leaves = [v.to(DEVICE, cast).clone().requires_grad_() for v in (x, w1, w2)]
        leaves.append(gates.to(DEVICE).clone().requires_grad_())
        xx, ww1, ww2, gg = leaves
        xs, info = permute(xx, idx.to(DEVICE), num_experts=e, backend="torch")
        if fused:
            h = gather_grouped_mm(xx, ww1, info, trans_w=trans_w, backend=backend)
            y = grouped_mm_scatter(torch.tanh(h), ww2, info, gg, backend=backend)
        else:
            h = grouped_mm_ref(xs, ww1, info.counts, trans_w=trans_w)
            y = unpermute(grouped_mm_ref(torch.tanh(h), ww2, info.counts), info, gg, backend="torch")
        (y.float() * ds.to(DEVICE)).sum().backward()
        results.append((h.detach(), y.detach(), [v.grad for v in leaves]))
    return results


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize(
    "t, k, e, i, n", [(0, 2, 3, 24, 40), (3, 1, 1, 24, 40), (19, 2, 5, 40, 24), (23, 1, 64, 24, 100)]
)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_fused_matches_unfused(backend, t, k, e, i, n, trans_w):
    (h, y, grads), (h_ref, y_ref, grads_ref) = run_both(t, k, e, i, n, torch.float32, backend, trans_w)
    assert h.shape == h_ref.shape and y.shape == (t, i)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    for name, got, expect in zip(("x", "w1", "w2", "gates"), grads, grads_ref, strict=True):
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_fused_bf16_within_bf16_error(backend):
    (h, y, grads), (h_ref, y_ref, grads_ref) = run_both(29, 2, 5, 40, 24, torch.bfloat16, backend, False)
    assert y.dtype == torch.bfloat16
    for got, expect in [(h, h_ref), (y, y_ref), *zip(grads, grads_ref, strict=True)]:
        scale = float(expect.abs().max()) or 1.0
        assert float((got.float() - expect).abs().max()) <= 3e-2 * scale


@pytest.mark.parametrize("trans_w", [False, True])
def test_fused_fp64_gradients_are_computed_in_fp64(trans_w):
    """fp64 stays fp64 through every backward (x, both weights, gates): the fused ops agree with
    the unfused fp64 composition to fp64 rounding, where an fp32 step leaves them ~1e-8 apart."""
    t, k, e, i, n = 19, 2, 5, 40, 24
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, i, generator=g, dtype=torch.float64)
    w1 = torch.randn(*((e, n, i) if trans_w else (e, i, n)), generator=g, dtype=torch.float64)
    w2 = torch.randn(e, n, i, generator=g, dtype=torch.float64)
    gates = torch.rand(t, k, generator=g, dtype=torch.float64)
    ds = torch.randn(t, i, generator=g, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        leaves = [v.clone().requires_grad_() for v in (x, w1, w2, gates)]
        xx, ww1, ww2, gg = leaves
        xs, info = permute(xx, routing(t, k, e), num_experts=e, backend="torch")
        if fused:
            h = gather_grouped_mm(xx, ww1, info, trans_w=trans_w, backend="torch")
            y = grouped_mm_scatter(torch.tanh(h), ww2, info, gg, backend="torch")
        else:
            h = grouped_mm(xs, ww1, info.counts, trans_w=trans_w, backend="torch")
            y = unpermute(grouped_mm(torch.tanh(h), ww2, info.counts, backend="torch"), info, gg, backend="torch")
        assert y.dtype == torch.float64
        (y * ds).sum().backward()
        grads.append([v.grad for v in leaves])
    for name, got, expect in zip(("x", "w1", "w2", "gates"), *grads, strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")


def test_gradcheck_opcheck_and_compile():
    t, k, e, i, n = 7, 2, 3, 5, 4
    x = torch.randn(t, i, dtype=torch.float64, requires_grad=True)
    w = torch.randn(e, i, n, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(e, n, i, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(t, k, dtype=torch.float64, requires_grad=True)
    _, info = permute(x, routing(t, k, e), num_experts=e, backend="torch")

    def f(x_, w_, w2_, g_):
        return grouped_mm_scatter(gather_grouped_mm(x_, w_, info, backend="torch"), w2_, info, g_, backend="torch")

    torch.autograd.gradcheck(f, (x, w, w2, gates))
    scale = gates.detach().reshape(-1)[info.slot]
    h = gather_grouped_mm(x, w, info, backend="torch").detach()
    # inputs that require grad, so opcheck runs the registered backwards too
    torch_library.opcheck(torch.ops.moe.gather_mm.default, (x, w, info.slot, info.counts, k, False, "torch", x.dtype))
    torch_library.opcheck(
        torch.ops.moe.mm_scatter.default,
        (h.requires_grad_(), w2, info.slot, scale.requires_grad_(), info.counts, t, k, False, "torch"),
    )
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # a graph break raises
    leaves = [v.detach().float().requires_grad_() for v in (x, w, w2, gates)]
    compiled(*leaves).square().sum().backward()
    eager = [v.detach().float().requires_grad_() for v in (x, w, w2, gates)]
    f(*eager).square().sum().backward()
    for a, b in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_fused_bad_input_raises():
    x = torch.randn(6, 8)
    xs, info = permute(x, routing(6, 2, 4), num_experts=4)
    w = torch.randn(4, 8, 16)
    with pytest.raises(ValueError, match="info must be the PermuteInfo"):
        gather_grouped_mm(x, w, info.counts)
    with pytest.raises(ValueError, match="x must have 6 rows"):
        gather_grouped_mm(x[:5], w, info)
    with pytest.raises(ValueError, match="inner dim"):
        gather_grouped_mm(x, torch.randn(4, 7, 16), info)
    with pytest.raises(ValueError, match="weights must be"):
        grouped_mm_scatter(grouped_mm(xs, w, info.counts), torch.randn(4, 16, 8), info, torch.rand(6, 1))


@pytest.mark.gpu
def test_fused_real_sizes_on_gpu():
    (h, y, grads), (h_ref, y_ref, grads_ref) = run_both(4096, 2, 8, 1024, 1408, torch.bfloat16, "triton", False)
    for got, expect in [(h, h_ref), (y, y_ref), *zip(grads, grads_ref, strict=True)]:
        assert float((got.float() - expect).abs().max()) <= 3e-2 * float(expect.abs().max())
