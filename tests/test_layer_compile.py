"""The MoE layer under torch.compile(fullgraph=True): no graph break, and the same outputs,
gradients and aux loss as eager, for every router on one device.

aot_eager traces forward and backward like inductor does, without generating code, so these
stay quick on CPU. Legend: B batch, S sequence, D model dim.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe import MoE, MoEConfig, aux_loss

_SMALL = dict(dim=16, hidden_dim=24, num_experts=5)

CASES = {
    "tiny": MoEConfig.from_name("tiny"),
    "topk-softmax-losses": MoEConfig(**_SMALL, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001),
    "topk-sigmoid-losses": MoEConfig(
        **_SMALL, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001, router_options=dict(score_func="sigmoid")
    ),
    "topk-shared": MoEConfig(**_SMALL, top_k=1, num_shared_experts=1, fused=True),
    "topk-groups-bias": MoEConfig(
        dim=16,
        hidden_dim=24,
        num_experts=6,
        top_k=2,
        num_shared_experts=1,
        router_options=dict(score_func="sigmoid", n_groups=3, topk_groups=2, bias_update_rate=0.01),
    ),
    "tiny-base": MoEConfig.from_name("tiny-base"),
    "base-approx-k2": MoEConfig(**_SMALL, top_k=2, router="base", router_options=dict(base_solver="approx")),
    "sinkhorn": MoEConfig(**_SMALL, top_k=2, router="sinkhorn", aux_loss_coef=0.01),
    "expert_choice": MoEConfig(**_SMALL, top_k=2, router="expert_choice", z_loss_coef=0.001),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # every test compiles MoE.forward anew; without a reset they share its recompile limit
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(layer: MoE, run, x_BSD: torch.Tensor, w_BSD: torch.Tensor):
    """One forward + backward through ``run`` (the layer or its compiled form): output, aux loss,
    the input's gradient and every parameter's gradient."""
    layer.zero_grad(set_to_none=True)
    x = x_BSD.clone().requires_grad_(True)
    y = run(x, seq_len=x_BSD.shape[1])
    aux = aux_loss(layer)
    ((y * w_BSD).sum() + aux).backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), aux.detach(), x.grad, grads


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_matches_eager(name: str, training: bool) -> None:
    cfg = CASES[name]
    torch.manual_seed(0)
    eager = MoE(cfg).train(training)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)  # raises on any graph break
    x_BSD = torch.randn(2, 7, cfg.dim)
    w_BSD = torch.randn(2, 7, cfg.dim)
    for _ in range(2):  # the second step runs with a loss already collected once
        y_e, aux_e, gx_e, g_e = _step(eager, eager, x_BSD, w_BSD)
        y_c, aux_c, gx_c, g_c = _step(twin, compiled, x_BSD, w_BSD)
        torch.testing.assert_close(y_c, y_e)
        torch.testing.assert_close(aux_c, aux_e)
        torch.testing.assert_close(gx_c, gx_e)
        assert g_c.keys() == g_e.keys() and g_e
        for key in g_e:
            torch.testing.assert_close(g_c[key], g_e[key], msg=key)
        for (key, b_c), (_, b_e) in zip(twin.named_buffers(), eager.named_buffers(), strict=True):
            torch.testing.assert_close(b_c, b_e, msg=key)  # the top-k bias moved alike
        assert twin._pending_loss is None  # aux_loss collected the compiled forward's loss
        torch.testing.assert_close(twin.last_routing.expert_idx, eager.last_routing.expert_idx)
        assert twin.last_routing.stats is None  # host-read floats are not made in a graph


def test_compiled_two_forwards_sum_their_losses() -> None:
    cfg = CASES["topk-softmax-losses"]
    torch.manual_seed(0)
    eager = MoE(cfg)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    a, b = torch.randn(5, cfg.dim), torch.randn(3, cfg.dim)
    eager(a), eager(b)
    compiled(a), compiled(b)
    torch.testing.assert_close(aux_loss(twin), aux_loss(eager))


def test_compiled_nan_input_raises_without_host_read() -> None:
    cfg = CASES["tiny"]
    compiled = torch.compile(MoE(cfg), backend="aot_eager", fullgraph=True)
    x = torch.randn(4, cfg.dim)
    compiled(x)
    x[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="x must be finite"):
        compiled(x)


def test_base_assign_op() -> None:
    from moe.routing import balanced_assignment, balanced_assignment_approx

    scores = torch.randn(9, 4)  # T * K = 18 on 4 experts: two take an extra slot, so extras matters
    torch.library.opcheck(torch.ops.moe.base_assign.default, (scores, 2, -1, False, "best"))
    for extras in ("best", "lowest"):
        got = torch.ops.moe.base_assign(scores, 2, -1, False, extras)
        torch.testing.assert_close(got, balanced_assignment(scores, 2, extras=extras))
        got = torch.ops.moe.base_assign(scores, 1, 5, True, extras)
        torch.testing.assert_close(got, balanced_assignment_approx(scores, 1, max_iters=5, extras=extras))


@pytest.mark.parametrize(
    "coefs",
    [
        pytest.param(dict(aux_loss_coef=0.0, z_loss_coef=0.001), id="z"),  # moe train's --aux-loss-coef 0
        pytest.param(dict(aux_loss_coef=0.01, z_loss_coef=0.0), id="aux", marks=pytest.mark.slow),  # ~20 s each
    ],
)
def test_inductor_one_loss_off_matches_eager(coefs: dict) -> None:
    """With one loss coefficient 0 the layer's loss is the other term alone: inductor folded
    ``0 + z`` into the buffer `last_routing` returns detached too, and the backward raised."""
    cfg = MoEConfig(**_SMALL, top_k=2, **coefs)
    torch.manual_seed(0)
    eager = MoE(cfg)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)  # inductor: its graph passes do the folding
    x_BSD, w_BSD = torch.randn(2, 7, cfg.dim), torch.randn(2, 7, cfg.dim)
    y_e, aux_e, gx_e, g_e = _step(eager, eager, x_BSD, w_BSD)
    y_c, aux_c, gx_c, g_c = _step(twin, compiled, x_BSD, w_BSD)
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(aux_c, aux_e)
    assert aux_e > 0  # the loss that is on is counted
    torch.testing.assert_close(gx_c, gx_e)
    for key in g_e:
        torch.testing.assert_close(g_c[key], g_e[key], msg=key)
    torch.testing.assert_close(twin.last_routing.z_loss + twin.last_routing.aux_loss, aux_e)
