"""The Triton grouped GEMM (forward, dgrad, wgrad) against the reference.

On CPU these run under Triton's interpreter (small shapes); marked `triton` so they can be
selected (`-m triton`), and `gpu` variants run real sizes where CUDA exists.
"""

import pytest
import torch

from moe.kernels import grouped_mm, grouped_mm_ref

from .test_grouped_mm import case, error_vs_fp32, grads

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("m, e, i, n", [(0, 3, 24, 40), (1, 1, 24, 40), (37, 5, 40, 24), (37, 64, 24, 40)])
def test_triton_matches_reference(m, e, i, n, dtype, trans_w):
    x, w, counts = case(m, e, i, n, dtype, trans_w)
    x = x.detach().to(DEVICE).requires_grad_()
    w = w.detach().to(DEVICE).requires_grad_()
    counts = counts.to(DEVICE)
    y = grouped_mm(x, w, counts, trans_w=trans_w, backend="triton")
    assert y.shape == (m, n) and y.dtype == dtype
    exact, plain_err = error_vs_fp32(x, w, counts, trans_w, dtype)
    if m:
        assert float((y.detach().float() - exact).abs().max()) <= 2 * plain_err + 1e-5
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    gx, gw = grads(lambda: grouped_mm(x, w, counts, trans_w=trans_w, backend="triton"), x, w, dy)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rx, rw = grads(lambda: grouped_mm_ref(x32, w32, counts, trans_w=trans_w), x32, w32, dy.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(gx.float(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw.float(), rw, rtol=tol, atol=tol)
    assert (gw[(counts == 0).nonzero().flatten()] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_real_sizes_on_gpu(dtype):
    x, w, counts = case(4096, 8, 1024, 1408, dtype, False)
    x, w, counts = x.detach().cuda(), w.detach().cuda(), counts.cuda()
    exact, plain_err = error_vs_fp32(x, w, counts, False, dtype)
    y = grouped_mm(x, w, counts, backend="triton")
    assert float((y.float() - exact).abs().max()) <= 2 * plain_err + 1e-3


def test_triton_backend_refuses_fp64_and_cpu_without_interpreter(monkeypatch):
    tgm = pytest.importorskip("moe.kernels.triton_grouped_mm")
    x, w, counts = case(8, 2, 16, 16, torch.float64, False)
    with pytest.raises(ValueError, match="float64"):
        grouped_mm(x.to(DEVICE), w.to(DEVICE), counts.to(DEVICE), backend="triton")

    monkeypatch.setattr(tgm, "_INTERPRET", False)
    x, w, counts = case(8, 2, 16, 16, torch.float32, False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        grouped_mm(x.cpu(), w.cpu(), counts, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gpu_tile_sizes(monkeypatch, dtype):
    # the interpreter normally uses 16x16x16 tiles; run the GPU tiles too (ragged against every edge)
    tgm = pytest.importorskip("moe.kernels.triton_grouped_mm")
    monkeypatch.setattr(tgm, "_blocks", lambda dt: (64, 128, 64) if dt != torch.float32 else (64, 64, 32))
    x, w, counts = case(150, 3, 72, 136, dtype, False)
    x, w = x.detach().to(DEVICE).requires_grad_(), w.detach().to(DEVICE).requires_grad_()
    counts = counts.to(DEVICE)
    exact, plain_err = error_vs_fp32(x, w, counts, False, dtype)
    y = grouped_mm(x, w, counts, backend="triton")
    assert float((y.detach().float() - exact).abs().max()) <= 2 * plain_err + 1e-4
    y.float().sum().backward()
    ref_w = torch.stack([x_e.detach().float().sum(0)[:, None].expand(72, 136) for x_e in x.split(counts.tolist())])
    torch.testing.assert_close(w.grad.float(), ref_w, rtol=2e-2, atol=2e-2)
