"""grouped_mm against its reference: forward and gradients, awkward shapes, fp32 and bf16."""

from functools import partial

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import library as torch_library

from moe.kernels import grouped_mm, grouped_mm_ref, workspace


def random_counts(m: int, e: int, g: torch.Generator) -> torch.Tensor:
    """E counts summing to M, some of them zero."""
    if e == 1:
        return torch.tensor([m])
    cuts = torch.randint(0, m + 1, (e - 1,), generator=g).sort().values
    return torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([m])]))


def case(m, e, i, n, dtype, trans_w, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, i, generator=g).to(dtype).requires_grad_()
    shape = (e, n, i) if trans_w else (e, i, n)
    w = (torch.randn(*shape, generator=g) / i**0.5).to(dtype).requires_grad_()
    return x, w, random_counts(m, e, g)


def grads(fn, x, w, dy):
    x.grad = w.grad = None
    fn().backward(dy)
    return x.grad.clone(), w.grad.clone()


def error_vs_fp32(x, w, counts, trans_w, dtype):
    """Max error of plain PyTorch in ``dtype`` against the fp32 reference (the tolerance policy)."""
    exact = grouped_mm_ref(x.detach().float(), w.detach().float(), counts, trans_w=trans_w)
    plain = grouped_mm_ref(x.detach(), w.detach(), counts, trans_w=trans_w)  # rounds like PyTorch in dtype
    return exact, float((plain.float() - exact).abs().max()) if exact.numel() else 0.0


@pytest.mark.parametrize("backend", ["torch", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize(
    "m, e, i, n", [(0, 3, 24, 40), (1, 1, 24, 40), (37, 5, 100, 24), (37, 64, 40, 100), (64, 5, 24, 24)]
)
def test_forward_and_backward_match_reference(m, e, i, n, dtype, trans_w, backend):
    x, w, counts = case(m, e, i, n, dtype, trans_w)
    y = grouped_mm(x, w, counts, trans_w=trans_w, backend=backend)
    assert y.shape == (m, n) and y.dtype == dtype
    exact, plain_err = error_vs_fp32(x, w, counts, trans_w, dtype)
    if m:
        assert float((y.detach().float() - exact).abs().max()) <= 2 * plain_err + 1e-5
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    gx, gw = grads(lambda: grouped_mm(x, w, counts, trans_w=trans_w, backend=backend), x, w, dy)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rx, rw = grads(lambda: grouped_mm_ref(x32, w32, counts, trans_w=trans_w), x32, w32, dy.float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(gx.float(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw.float(), rw, rtol=tol, atol=tol)
    empty = (counts == 0).nonzero().flatten()
    assert torch.isfinite(gw).all() and (gw[empty] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_w", [False, True])
def test_large_results_in_kept_memory_match_reference(dtype, trans_w):
    # results of 1 MiB and more come from the loop writing into kept memory (`workspace`); the
    # second call runs in what the first left dirty, with an expert the first one fed now empty
    workspace.release()
    for seed, counts in enumerate([torch.tensor([200, 120, 200]), torch.tensor([300, 0, 220])]):
        x, w, _ = case(520, 3, 256, 1040, dtype, trans_w, seed)
        dy = torch.randn(520, 1040, generator=torch.Generator().manual_seed(seed)).to(dtype)
        gx, gw = grads(partial(grouped_mm, x, w, counts, trans_w=trans_w), x, w, dy)
        x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        rx, rw = grads(partial(grouped_mm_ref, x32, w32, counts, trans_w=trans_w), x32, w32, dy.float())
        y = grouped_mm(x, w, counts, trans_w=trans_w)
        exact, plain_err = error_vs_fp32(x, w, counts, trans_w, dtype)
        assert float((y.detach().float() - exact).abs().max()) <= 2 * plain_err + 1e-5
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(gx.float(), rx, rtol=tol, atol=tol)
        torch.testing.assert_close(gw.float(), rw, rtol=tol, atol=tol)
    assert bool((gw[1] == 0).all()) and workspace.kept_bytes() > 0


@given(st.integers(0, 40), st.integers(1, 6), st.integers(0, 10**6))
def test_equals_per_row_loop_and_splits(m, e, seed):
    x, w, counts = case(m, e, 8, 12, torch.float64, False, seed)
    x, w = x.detach(), w.detach()
    y = grouped_mm(x, w, counts)
    expert_of_row = torch.repeat_interleave(torch.arange(e), counts)
    for r in range(m):
        torch.testing.assert_close(y[r], x[r] @ w[expert_of_row[r]])
    # splitting one expert's rows over two calls gives the same rows
    offs = [0, *counts.cumsum(0).tolist()]
    for ex in range(e):
        a, b = offs[ex], offs[ex + 1]
        h = (a + b) // 2
        only = torch.zeros(e, dtype=torch.int64)
        first = grouped_mm(x[a:h], w, only.index_fill(0, torch.tensor([ex]), h - a))
        second = grouped_mm(x[h:b], w, only.index_fill(0, torch.tensor([ex]), b - h))
        torch.testing.assert_close(torch.cat([first, second]), y[a:b])


@pytest.mark.parametrize("backend", ["torch", "ref", "triton"])
def test_out_dtype_keeps_fp32_accumulation(backend):
    x, w, counts = case(30, 4, 16, 8, torch.bfloat16, False)
    y = grouped_mm(x, w, counts, out_dtype=torch.float32, backend=backend)
    exact = grouped_mm_ref(x.detach().double(), w.detach().double(), counts)
    assert y.dtype == torch.float32
    assert float((y.detach().double() - exact).abs().max()) < 1e-4  # not rounded through bf16 on the way


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_out_dtype_of_the_other_half_precision_multiplies_in_fp32(dtype, out_dtype):
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(*s, generator=g).to(dtype) for s in ((600, 64), (2, 64, 1024)))  # results > 1 MiB
    if dtype == torch.float16:
        x[0] = 5000.0  # a row whose products sum past fp16's range (65504); bf16 holds them
    counts = torch.tensor([300, 300])
    y = grouped_mm(x, w, counts, out_dtype=out_dtype, backend="torch")
    exact = grouped_mm_ref(x.double(), w.double(), counts)
    assert exact.abs().max() < 65504 or dtype == torch.float16  # fp16 results hold what they must
    assert y.dtype == out_dtype
    torch.testing.assert_close(y, grouped_mm(x, w, counts, out_dtype=out_dtype, backend="ref"), rtol=0, atol=0)
    # rounded once from fp32: within one step of the exact result (not inf, not bf16's coarser step)
    eps = torch.finfo(out_dtype).eps
    torch.testing.assert_close(y.double(), exact.double(), rtol=eps, atol=1e-3)


def test_backends_agree_and_compile_without_graph_breaks():
    x, w, counts = case(30, 4, 16, 8, torch.float32, False)
    y32 = grouped_mm(x, w, counts, backend="torch")
    torch.testing.assert_close(grouped_mm(x, w, counts, backend="ref"), y32)

    def f(x_, w_, c_):
        return grouped_mm(x_, w_, c_, trans_w=False, backend="torch").square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    compiled(xg, wg, counts).backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    f(x2, w2, counts).backward()
    torch.testing.assert_close(xg.grad, x2.grad)
    torch.testing.assert_close(wg.grad, w2.grad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "cuda"}, "backend"),
        ({"counts": torch.tensor([10, 10, 10])}, "counts must have one entry"),
        ({"counts": torch.tensor([10, 10, 5, 4])}, "sum to the M"),
        ({"counts": torch.tensor([10.0, 10, 5, 5])}, "integer"),
        ({"counts": torch.tensor([10, 10, 5, 5], device="meta")}, "on the CPU"),
        ({"x": torch.randn(30, 15)}, "inner dim"),
        ({"w": torch.randn(4, 16, 8, dtype=torch.float64)}, "dtype"),
        ({"w": torch.randn(0, 16, 8), "counts": torch.zeros(0, dtype=torch.int64)}, "at least one expert"),
    ],
)
def test_bad_input_raises(kwargs, match):
    x, w, counts = case(30, 4, 16, 8, torch.float32, False)
    args = {"x": x, "w": w, "counts": counts, "backend": "auto"} | kwargs
    with pytest.raises(ValueError, match=match):
        grouped_mm(args["x"], args["w"], args["counts"], backend=args["backend"])


def test_backward_accepts_expanded_gradients():
    # y.sum() sends back a stride-0 gradient, which torch._grouped_mm's own CPU backward rejects
    x, w, counts = case(32, 4, 16, 8, torch.float32, False)
    grouped_mm(x, w, counts).sum().backward()
    expect = torch.stack([x_e.detach().sum(0)[:, None].expand(16, 8) for x_e in x.split(counts.tolist())])
    torch.testing.assert_close(w.grad, expect)


@pytest.mark.parametrize("backend", ["torch", "ref"])
@pytest.mark.parametrize("trans_w", [False, True])
def test_gradcheck_fp64_and_opcheck(backend, trans_w):
    x, w, counts = case(13, 3, 5, 4, torch.float64, trans_w)
    torch.autograd.gradcheck(lambda x_, w_: grouped_mm(x_, w_, counts, trans_w=trans_w, backend=backend), (x, w))
    torch_library.opcheck(torch.ops.moe.grouped_mm.default, (x, w, counts, trans_w, backend, torch.float64))


@pytest.mark.parametrize("trans_w", [False, True])
def test_eager_path_equals_the_op_and_has_second_derivatives(trans_w):
    # eager CPU calls skip the custom op's dispatch: the same values and gradients as the op,
    # and a backward with create_graph goes through the op, so dX's derivatives flow
    x, w, counts = case(29, 4, 16, 8, torch.float32, trans_w)
    dy = torch.randn(29, 8, generator=torch.Generator().manual_seed(1))
    with torch.profiler.profile() as prof:
        y = grouped_mm(x, w, counts, trans_w=trans_w, backend="torch")
        grads = torch.autograd.grad(y, (x, w), dy)
    keys = {ev.key for ev in prof.key_averages()}
    assert "_EagerGroupedMMBackward" in keys and "moe::grouped_mm_wgrad" not in keys  # the eager path ran
    assert "moe::grouped_mm" in keys  # and a trace still names it as the op
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = torch.ops.moe.grouped_mm(x2, w2, counts, trans_w, "torch", torch.float32)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    for got, want in zip(grads, torch.autograd.grad(y2, (x2, w2), dy), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    x64, w64, c64 = case(11, 3, 5, 4, torch.float64, trans_w)  # dX is differentiable (dW is not, as in the op)
    w64 = w64.detach()
    torch.autograd.gradgradcheck(lambda x_: grouped_mm(x_, w64, c64, trans_w=trans_w, backend="torch"), (x64,))


def test_unaligned_weights_and_single_input_grads():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 24, 41, generator=g)[..., :40]  # row stride of 41 floats: not 16-byte aligned
    x, counts = torch.randn(37, 24, generator=g), torch.tensor([10, 0, 7, 20, 0])
    torch.testing.assert_close(grouped_mm(x, w, counts), grouped_mm_ref(x, w, counts))
    xg = x.clone().requires_grad_()
    grouped_mm(xg, w, counts).sum().backward()  # only x needs a gradient
    assert xg.grad is not None and xg.grad.shape == x.shape


def test_auto_backend_on_cpu_needs_no_triton():
    # triton is a Linux-only dependency: away from CUDA, "auto" must not import it
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch; sys.modules['triton'] = None\n"
        "from moe.kernels import grouped_mm, permute\n"
        "x = torch.randn(8, 16); print(tuple(grouped_mm(x, torch.randn(2, 16, 8), torch.tensor([3, 5])).shape))\n"
        "print(tuple(permute(x, torch.zeros(8, 1, dtype=torch.int64), num_experts=2)[0].shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(8,", "8)", "(8,", "16)"]
