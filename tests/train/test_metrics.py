"""`LoadCounter`: the balance it logs is the routers' own (`RoutingResult.stats`) for one
forward, micro-batches add up to the whole batch, and evaluation forwards do not count."""

import dataclasses

import pytest
import torch

from moe.models.llama import Llama, LlamaConfig
from moe.train.metrics import LoadCounter, moe_layer_keys


def _model(router: str, **moe) -> Llama:
    cfg = LlamaConfig.from_name("tiny")
    options = {"top_k": 1, "combine": "sigmoid_residual"} if router == "base" else {}
    cfg = LlamaConfig.from_name("tiny", moe=dataclasses.replace(cfg.moe, router=router, **options, **moe))
    torch.manual_seed(0)
    return Llama(cfg)


@pytest.mark.parametrize(
    ("router", "moe"),
    [("topk", {"capacity_factor": 0.5}), ("base", {}), ("sinkhorn", {}), ("expert_choice", {})],
    ids=["topk_dropping", "base", "sinkhorn", "expert_choice"],
)
def test_one_forward_gives_the_routers_own_stats(router, moe):
    model = _model(router, **moe)
    counter = LoadCounter(model, moe_layer_keys(model), model.config.moe.num_experts, "cpu", preferred=router == "base")
    model(torch.randint(0, model.config.vocab_size, (3, 10)))
    stats = counter.stats()
    assert sorted(stats) == ["1", "3"]
    for key, got in stats.items():
        res = model.layers[key].feed_forward.last_routing
        want = res.stats
        assert got["max_load"] == pytest.approx(want.max_load, rel=1e-12)
        assert got["cv"] == pytest.approx(want.load_cv, rel=1e-12, abs=1e-15)
        assert got["dropped"] == pytest.approx(want.dropped_fraction, rel=1e-12)
        assert got["load"] == pytest.approx((res.counts.double() / res.counts.sum()).tolist(), rel=1e-12)
        if router == "base":  # the share of slots on one of their token's K best experts
            assert got["preferred"] == int(res.preferred) / res.expert_idx.numel() and 0 < got["preferred"] <= 1
        else:
            assert "preferred" not in got
    if router == "topk":
        assert all(s["dropped"] > 0 for s in stats.values())  # the capacity drops some slots


def test_micro_batches_add_up_and_evaluation_does_not_count():
    model = _model("topk")
    counter = LoadCounter(model, moe_layer_keys(model), model.config.moe.num_experts, "cpu")
    tokens = torch.randint(0, model.config.vocab_size, (4, 12))
    model(tokens)
    whole = counter.stats()
    counter.reset()
    for half in tokens.chunk(2):
        model(half)
    model.eval()
    model(tokens[:1])
    assert counter.stats() == whole
