"""permute / unpermute against the references; identity and gradient properties."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe.kernels import permute, permute_ref, permute_rows, sort_slots, unpermute, unpermute_ref, workspace

from ..host_reads import HostReads


def routing(t, e, k, seed, drop=0.2):
    g = torch.Generator().manual_seed(seed)
    idx = (
        torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        if t
        else torch.zeros(0, k, dtype=torch.int64)
    )
    idx = torch.where(torch.rand(t, k, generator=g) < drop, -1, idx)
    return idx, torch.rand(t, k, generator=g)


@given(st.integers(0, 30), st.integers(1, 9), st.integers(1, 3), st.integers(0, 10**6))
def test_matches_reference_exactly(t, e, k, seed):
    k = min(k, e)
    idx, weights = routing(t, e, k, seed)
    x = torch.randn(t, 5, generator=torch.Generator().manual_seed(seed))
    xs, info = permute(x, idx, num_experts=e)
    ref_x, ref_slot, ref_counts = permute_ref(x, idx, e)
    assert torch.equal(info.slot, ref_slot) and torch.equal(info.counts, ref_counts)
    assert torch.equal(xs, ref_x)
    assert torch.equal(info.offsets, torch.cat([torch.zeros(1, dtype=torch.int64), ref_counts.cumsum(0)]))
    y = torch.randn(xs.shape[0], 5)
    torch.testing.assert_close(unpermute(y, info, weights), unpermute_ref(y, info.slot, weights))


@given(st.integers(0, 30), st.integers(1, 9), st.integers(1, 3), st.integers(0, 10**6))
def test_known_row_count_gives_the_same_info_without_host_reads(t, e, k, seed):
    k = min(k, e)
    idx, _ = routing(t, e, k, seed)
    want, kept = sort_slots(idx, num_experts=e), int((idx >= 0).sum())
    with HostReads(idx) as seen:
        got = sort_slots(idx, num_experts=e, num_rows=kept)
    assert seen.reads == []
    for name in ("slot", "token", "counts", "offsets", "row_of_slot"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with HostReads(idx) as seen:
        sort_slots(idx, num_experts=e)
    assert seen.reads or idx.numel() == 0  # without num_rows the range and M are read back


def test_known_row_count_is_checked():
    idx = torch.tensor([[0, 1], [2, -1]])
    with pytest.raises(RuntimeError, match="num_rows = 4"):
        sort_slots(idx, num_experts=3, num_rows=4)
    with pytest.raises(RuntimeError, match=r"\[-1, 2\)"):
        sort_slots(idx, num_experts=2, num_rows=3)
    for bad in (5, -1, 2.0):
        with pytest.raises(ValueError, match="num_rows"):
            sort_slots(idx, num_experts=3, num_rows=bad)


@given(st.integers(1, 30), st.integers(1, 9), st.integers(1, 3), st.integers(0, 10**6))
def test_permute_then_unpermute_with_unit_weights_is_identity(t, e, k, seed):
    k = min(k, e)
    idx, _ = routing(t, e, k, seed, drop=0.0)
    x = torch.randn(t, 4, dtype=torch.float64)
    xs, info = permute(x, idx, num_experts=e)
    torch.testing.assert_close(unpermute(xs, info, torch.ones(t, k, dtype=torch.float64) / k), x)


def test_gradients():
    idx, weights = routing(12, 5, 2, 0)
    x = torch.randn(12, 6, dtype=torch.float64, requires_grad=True)
    w = weights.double().requires_grad_()
    xs, info = permute(x, idx, num_experts=5)
    y = xs * torch.linspace(0.5, 2, xs.shape[0], dtype=torch.float64)[:, None]  # any per-row function
    out = unpermute(y, info, w)
    both = lambda x_, w_: unpermute(permute(x_, idx, num_experts=5)[0] * 2.0, info, w_)  # noqa: E731
    assert torch.autograd.gradcheck(both, (x, w)) and torch.autograd.gradgradcheck(both, (x, w))
    dy = torch.randn_like(out)
    out.backward(dy)
    # d weights[t, j] = <dy[t], y[row of slot t*K+j]>; dropped slots get zero
    expect = torch.zeros(12 * 2, dtype=torch.float64)
    expect[info.slot] = (dy[info.token] * y.detach()).sum(1)
    torch.testing.assert_close(w.grad.reshape(-1), expect)


@pytest.mark.parametrize("gates", ["fp32", "rows"], ids=["fp32_gates", "gates_in_rows_dtype"])
@pytest.mark.parametrize("drop", [0.2, 0.0], ids=["dropped", "every_slot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_rows_in_kept_memory_match_reference(dtype, drop, gates):
    # (M, D) results of 1 MiB and more live in `workspace` memory; the second round runs in what
    # the first left dirty, with other routing. With every slot kept (M = T K) the combine and
    # permute's backward gather each token's rows instead of scattering them; with bf16 gates
    # (the layer passes its gates in the rows' dtype) the combine and its backward are batched
    # matmuls in bf16, against the reference in fp32 with the same gates.
    workspace.release()
    for seed in range(2):
        idx, weights = routing(600, 7, 2, seed, drop=drop)
        weights = weights if gates == "fp32" else weights.to(dtype)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(600, 1024, generator=g).to(dtype).requires_grad_()
        w = weights.requires_grad_()
        xs, info = permute(x, idx, num_experts=7)
        y = xs * torch.linspace(0.5, 2, xs.shape[0])[:, None].to(dtype)
        out = unpermute(y, info, w)
        dout = torch.randn(out.shape, generator=g).to(dtype)
        out.backward(dout)
        x32, w32 = x.detach().float().requires_grad_(), weights.detach().float().requires_grad_()
        ref_xs, slot, _ = permute_ref(x32, idx, 7)
        ref_y = ref_xs * torch.linspace(0.5, 2, xs.shape[0])[:, None].to(dtype).float()
        ref = unpermute_ref(ref_y, slot, w32)
        ref.backward(dout.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.equal(xs.float(), ref_xs)
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad.float(), x32.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(w.grad.float(), w32.grad, rtol=tol, atol=tol * 10)
    assert workspace.kept_bytes() > 0


def test_bf16_and_dropped_tokens():
    idx = torch.tensor([[0, -1], [-1, -1], [1, 0]])
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    xs, info = permute(x, idx, num_experts=3)
    assert info.counts.tolist() == [2, 1, 0] and info.token.tolist() == [0, 2, 2]
    out = unpermute(xs, info, torch.ones(3, 2))
    assert out.dtype == torch.bfloat16 and (out[1] == 0).all()


@pytest.mark.parametrize(
    "idx, match",
    [
        (torch.tensor([[0], [3]]), r"\[-1, 3\)"),
        (torch.tensor([[0], [-2]]), r"\[-1, 3\)"),
        (torch.tensor([[0.0], [1.0]]), "int64"),
        (torch.tensor([[0]]), "T=2"),
    ],
)
def test_bad_input_raises(idx, match):
    with pytest.raises(ValueError, match=match):
        permute(torch.randn(2, 4), idx, num_experts=3)


@pytest.mark.parametrize("num_experts", [2.5, 3.0, True, 0])
def test_num_experts_must_be_an_int(num_experts):
    idx = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"num_experts must be an int >= 1, got {num_experts!r}"):
        permute(torch.randn(2, 4), idx, num_experts=num_experts)
    with pytest.raises(ValueError, match="num_experts must be an int"):
        sort_slots(idx, num_experts=num_experts)


def test_torch_path_compiles_without_graph_breaks():
    idx, weights = routing(12, 5, 2, 0)
    info = sort_slots(idx, num_experts=5)

    def f(x_, w_):
        return unpermute(permute_rows(x_, info, backend="torch") * 2.0, info, w_, backend="torch").square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # a graph break raises
    x = torch.randn(12, 6, requires_grad=True)
    w = weights.clone().requires_grad_()
    compiled(x, w).backward()
    x2, w2 = x.detach().requires_grad_(), weights.clone().requires_grad_()
    f(x2, w2).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_torch_func_and_forward_mode_ad():
    import torch.autograd.forward_ad as fwad

    idx, weights = routing(12, 5, 2, 0)
    info = sort_slots(idx, num_experts=5)
    x = torch.randn(12, 6, dtype=torch.float64)
    w = weights.double()

    def both(x_, w_):
        return unpermute(permute_rows(x_, info) * 2.0, info, w_)

    def plain(x_, w_):
        return unpermute_ref(permute_ref(x_, idx, 5)[0] * 2.0, info.slot, w_)

    for got, want in zip(torch.func.jacrev(both, (0, 1))(x, w), torch.func.jacrev(plain, (0, 1))(x, w), strict=True):
        torch.testing.assert_close(got, want)
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    with fwad.dual_level():
        tangent = fwad.unpack_dual(both(fwad.make_dual(x, tx), fwad.make_dual(w, tw))).tangent
    torch.testing.assert_close(tangent, torch.func.jvp(plain, (x, w), (tx, tw))[1])
