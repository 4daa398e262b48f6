"""swiglu_ffn (one expert at a time) against the whole-row form of three grouped_mm: the same
results and gradients bit for bit, the memory autograd keeps, and where the layer takes it."""

import pytest
import torch

from moe.experts import GroupedExperts
from moe.kernels import expert_ffn, grouped_mm, swiglu, workspace
from moe.kernels.expert_ffn import swiglu_ffn


def whole_row(x, w1, w3, w2, counts):
    h, up = grouped_mm(x, w1, counts), grouped_mm(x, w3, counts)
    return grouped_mm(swiglu(h, up), w2, counts)


def problem(counts, d, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, m = len(counts), sum(counts)
    x = torch.randn(m, d, generator=g).to(dtype)
    ws = [(torch.randn(e, *s, generator=g) * 0.1).to(dtype) for s in ((d, f), (d, f), (f, d))]
    return [x, *ws], torch.tensor(counts)


def grads(fn, inputs, counts, dy, needs=(True, True, True, True)):
    leaves = [t.clone().requires_grad_(n) for t, n in zip(inputs, needs, strict=True)]
    y = fn(*leaves, counts)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


COUNTS = {
    "uneven, one expert empty": [700, 0, 300, 1048],
    "all rows in one expert": [0, 2048, 0, 0],
    "no rows": [0, 0, 0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_equals_the_whole_row_form_bit_for_bit(counts, dtype):
    workspace.release()
    for seed in range(2):  # the second call runs in the memory the first one left dirty
        inputs, c = problem(counts, 128, 256, dtype, seed)
        dy = torch.randn(sum(counts), 128, generator=torch.Generator().manual_seed(seed + 7)).to(dtype)
        ours, ref = grads(swiglu_ffn, inputs, c, dy), grads(whole_row, inputs, c, dy)
        for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), ours, ref, strict=True):
            assert a.dtype == dtype and a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        if counts[1] == 0:  # an expert without rows: zero weight gradients, not stale memory
            assert all(bool((g[1] == 0).all()) for g in ours[2:])


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no input needs a gradient"])
def test_inference_keeps_no_hidden_activations_of_all_rows(mode, monkeypatch):
    inputs, c = problem([300, 0, 212], 32, 64, torch.float32)
    if mode != "no input needs a gradient":
        inputs = [inputs[0]] + [w.requires_grad_() for w in inputs[1:]]  # as a layer's parameters
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    made = []
    real = workspace.empty
    monkeypatch.setattr(workspace, "empty", lambda shape, *a: made.append(shape) or real(shape, *a))
    with context():
        y = swiglu_ffn(*inputs, c)
    assert not y.requires_grad
    assert (512, 64) not in made and made.count((300, 64)) == 3  # gate, up and product: one expert's rows
    monkeypatch.undo()
    with torch.no_grad():
        torch.testing.assert_close(y, whole_row(*inputs, c), rtol=0, atol=0)


def test_only_the_gradients_asked_for():
    inputs, c = problem([40, 0, 24], 16, 32, torch.float32)
    dy = torch.randn(64, 16)
    for needs in ((False, True, True, True), (True, False, False, False), (False, False, True, False)):
        ours, ref = grads(swiglu_ffn, inputs, c, dy, needs), grads(whole_row, inputs, c, dy, needs)
        for a, b, n in zip(ours[1:], ref[1:], needs, strict=True):
            assert (a is None) == (not n) and (b is None) == (not n)
            if n:
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_autograd_keeps_gate_and_up_not_the_product():
    inputs, c = problem([512, 512], 64, 256, torch.float32)
    hidden = 1024 * 256

    def saved_hidden(fn):
        seen = []

        def pack(t):
            if t.dim() == 2 and t.numel() == hidden:
                seen.append(t.untyped_storage().data_ptr())
            return t

        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*leaves, c)
        return len(set(seen))

    assert saved_hidden(swiglu_ffn) == 2  # gate and up; the product is made again in backward
    assert saved_hidden(whole_row) == 4  # gate, up, silu(gate) and the product


def test_a_trace_names_it():
    inputs, c = problem([300, 212], 32, 64, torch.float32)
    with torch.profiler.profile() as prof:
        swiglu_ffn(*[t.requires_grad_() for t in inputs], c).sum().backward()
    keys = {ev.key for ev in prof.key_averages()}
    assert "moe::swiglu_ffn" in keys and "_SwiGLUFFNBackward" in keys


def test_retain_graph_and_higher_derivatives():
    inputs, c = problem([3, 0, 4], 5, 6, torch.float64)
    leaves = [t.requires_grad_() for t in inputs]
    out = swiglu_ffn(*leaves, c).square().sum()
    first = torch.autograd.grad(out, leaves, retain_graph=True)
    second = torch.autograd.grad(out, leaves)  # the saved gate and up are read unchanged
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    assert torch.autograd.gradcheck(lambda *ts: swiglu_ffn(*ts, c), leaves)
    weights = [w.detach() for w in leaves[1:]]  # dX is differentiable (dW is not, as in grouped_mm)
    assert torch.autograd.gradgradcheck(lambda x: swiglu_ffn(x, *weights, c), leaves[:1])


def test_compiles_to_the_whole_row_form():
    inputs, c = problem([20, 12], 16, 32, torch.float32)
    compiled = torch.compile(lambda *ts: swiglu_ffn(*ts, c).sum(), backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in inputs]
    compiled(*leaves).backward()
    ref = grads(whole_row, inputs, c, torch.ones(32, 16))
    for a, b in zip([t.grad for t in leaves], ref[1:], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda ts, c: (ts[0], ts[1], ts[2][:, :, :-1], ts[3], c), r"w3 must be an \(2, 16, 24\) tensor"),
        (lambda ts, c: (ts[0], ts[1], ts[2], ts[3][:, :-1], c), r"w2 must be an \(2, 24, 16\) tensor"),
        (lambda ts, c: (ts[0], ts[1], ts[2], ts[3][:, :, :-1], c), r"w2 must be an \(2, 24, 16\) tensor"),
        (lambda ts, c: (ts[0], ts[1], ts[2], ts[3][:1], c), r"w2 must be .* got shape \(1, 24, 16\)"),
        (lambda ts, c: (ts[0], ts[1][:1], ts[2], ts[3], c), "counts must have one entry per expert"),
        (lambda ts, c: (ts[0], ts[1], ts[2], ts[3], c + 1), "sum to the M = 32 rows"),
        (lambda ts, c: (ts[0], ts[1], ts[2].double(), ts[3], c), "of w1's dtype torch.float32 on cpu, got .*float64"),
        (lambda ts, c: (ts[0], ts[1], ts[2].to("meta"), ts[3], c), "w3 must be .* on cpu, got .* on meta"),
    ],
)
def test_bad_input_raises(change, match):
    inputs, c = problem([20, 12], 16, 24, torch.float32)
    with pytest.raises(ValueError, match=match):
        swiglu_ffn(*change(inputs, c))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_take_it_by_dtype_and_rows_an_expert(activation, dtype, monkeypatch):
    calls = []
    real = expert_ffn._SwiGLUFFN.apply
    monkeypatch.setattr(expert_ffn._SwiGLUFFN, "apply", lambda *a: calls.append(1) or real(*a))
    experts = GroupedExperts(32, 64, 4, activation).to(dtype)
    x = torch.randn(512, 32).to(dtype)
    results = []
    for counts in ([200, 0, 100, 212], [200, 0, 100, 211]):  # 128 rows an expert on average, and fewer
        x_ = x[: sum(counts)].clone().requires_grad_()
        experts(x_, torch.tensor(counts)).square().sum().backward()
        results.append([x_.grad[:511]] + [p.grad.clone() for p in experts.parameters()])
        experts.zero_grad(set_to_none=True)
    assert len(calls) == (1 if activation == "swiglu" and dtype == torch.float32 else 0)
    monkeypatch.setattr(expert_ffn, "DTYPES", ())  # the whole-row form on the same rows
    x_ = x.clone().requires_grad_()
    experts(x_, torch.tensor([200, 0, 100, 212])).square().sum().backward()
    for a, b in zip(results[0], [x_.grad[:511]] + [p.grad for p in experts.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
