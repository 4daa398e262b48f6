"""What every router checks: its config is a RouterConfig, and its fp32 logits are finite, so a
finite x too large for them (1e38) raises instead of giving NaN gates."""

import pytest
import torch

from moe.routing import (
    BaseRouter,
    ExpertChoiceRouter,
    RouterConfig,
    SinkhornRouter,
    TopKRouter,
    build_router,
)

KINDS = ("base", "topk", "sinkhorn", "expert_choice")
D = 6


def router(kind: str, **options):
    torch.manual_seed(0)
    return build_router(RouterConfig(dim=D, num_experts=4, top_k=1, kind=kind, **options))


@pytest.mark.parametrize("cls", [BaseRouter, TopKRouter, SinkhornRouter, ExpertChoiceRouter])
@pytest.mark.parametrize("config", [{"dim": D, "num_experts": 4}, None, "topk"])
def test_routers_refuse_a_non_config(cls, config):
    with pytest.raises(ValueError, match=r"config must be a moe.routing.RouterConfig"):
        cls(config)


def test_a_layer_config_is_not_a_router_config():
    from moe import MoEConfig

    layer_cfg = MoEConfig.from_name("tiny")  # has dim, num_experts and top_k: it used to pass
    with pytest.raises(ValueError, match=r"got MoEConfig"):
        ExpertChoiceRouter(layer_cfg)
    with pytest.raises(ValueError, match=r"config must be a moe.routing.RouterConfig, got MoEConfig"):
        build_router(layer_cfg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("train", [True, False])
def test_finite_x_whose_logits_overflow_raises(kind, train):
    r = router(kind).train(train)
    with torch.no_grad():
        r.weight.fill_(1.0)  # each logit is the sum of D = 6 values of 1e38: beyond fp32's 3.4e38
    x = torch.full((5, D), 1e38)
    assert torch.isfinite(x).all()
    with pytest.raises(ValueError, match=r"x of shape \(5, 6\) is finite, but x @ weight.T overflows fp32"):
        r(x)
    res = r(x / 1e30)  # large but representable: routes, with finite gates
    assert torch.isfinite(res.weights).all()


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_x_still_names_x(kind):
    r = router(kind)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, D)
        x[1, 2] = bad
        with pytest.raises(ValueError, match=r"x must be finite: found NaN or Inf in a tensor of shape \(3, 6\)"):
            r(x)


def test_a_non_finite_router_weight_is_reported():
    r = router("topk")
    with torch.no_grad():
        r.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"or the router weight holds NaN or Inf"):
        r(torch.randn(3, D))


def test_device_side_check_covers_overflowing_logits():
    """The sync-free BASE path checks on the device (a RuntimeError on CPU), on the logits too."""
    r = router("base", base_solver="approx")
    r.sync_free = True
    with torch.no_grad():
        r.weight.fill_(1.0)
    with pytest.raises(RuntimeError, match="finite"):
        r(torch.full((5, D), 1e38))


def test_check_tokens_checks_values_unless_told_the_logits_are_checked():
    from moe.routing.common import check_tokens

    x = torch.full((2, D), float("nan"))
    with pytest.raises(ValueError, match="x must be finite"):
        check_tokens(x, D)
    with pytest.raises(RuntimeError, match="x must be finite"):
        check_tokens(x, D, host_check=False)
    check_tokens(x, D, values=False)  # shape and dtype only: the router checks the logits
