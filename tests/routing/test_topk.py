"""TopKRouter: selection, gates, group limits, capacity, bias balancing, losses, input checks.

Legend: T tokens, D model dim, E experts, K slots per token, G expert groups.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe.routing import RouterConfig, TopKRouter, load_balancing_loss, router_z_loss, sequence_load_balancing_loss

D = 6


def _router(seed=0, **kw):
    """A router whose gate has std 1, so scores are far from uniform and ties are unlikely."""
    r = TopKRouter(RouterConfig(dim=D, **kw))
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return r


def _x(T, seed=0):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 7))


def _scores(router, x_TD):
    logits = x_TD.float() @ router.weight.detach().float().T
    return logits.softmax(-1) if router.config.score_func == "softmax" else logits.sigmoid()


def _check_result(res, T, K, E):
    """RoutingResult invariants shared by every router."""
    idx, w = res.expert_idx, res.weights
    assert idx.shape == (T, K) and w.shape == (T, K) and res.counts.shape == (E,)
    assert w.dtype == torch.float32
    assert bool(((idx >= -1) & (idx < E)).all())
    kept = idx >= 0
    assert bool((w[~kept] == 0).all()), "a dropped slot must have weight 0"
    assert bool((w >= 0).all())
    assert int(res.counts.sum()) == int(kept.sum())
    assert torch.equal(res.counts, torch.bincount(idx[kept], minlength=E))
    for row in idx.tolist():  # no expert twice for one token
        chosen = [e for e in row if e >= 0]
        assert len(chosen) == len(set(chosen))
    assert res.aux_loss.dim() == 0 and res.z_loss.dim() == 0


@st.composite
def configs(draw, grouped=False):
    E = draw(st.integers(1, 9))
    groups = draw(st.sampled_from([g for g in range(1, E + 1) if E % g == 0])) if grouped else 1
    topk_groups = draw(st.integers(1, groups))
    K = draw(st.integers(1, topk_groups * (E // groups)))
    return dict(
        num_experts=E,
        top_k=K,
        n_groups=groups,
        topk_groups=topk_groups,
        score_func=draw(st.sampled_from(["softmax", "sigmoid"])),
        renormalize=draw(st.booleans()),
    )


tokens = st.integers(0, 20)
seeds = st.integers(0, 2**16)


@given(cfg=configs(), T=tokens, seed=seeds)
def test_chosen_scores_dominate_unchosen(cfg, T, seed):
    r = _router(seed, **cfg)
    x = _x(T, seed)
    res = r(x)
    _check_result(res, T, cfg["top_k"], cfg["num_experts"])
    s = _scores(r, x)
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(1, res.expert_idx, True)
    if 0 < cfg["top_k"] < cfg["num_experts"] and T:
        worst_chosen = s.masked_fill(~chosen, float("inf")).amin(1)
        best_other = s.masked_fill(chosen, float("-inf")).amax(1)
        assert bool((worst_chosen >= best_other).all())


@given(cfg=configs(), T=tokens, seed=seeds)
def test_gates_are_the_chosen_scores_renormalised_or_not(cfg, T, seed):
    r = _router(seed, **cfg)
    x = _x(T, seed)
    res = r(x)
    picked = _scores(r, x).gather(1, res.expert_idx)
    assert bool((res.weights >= 0).all())
    if cfg["renormalize"]:
        torch.testing.assert_close(res.weights.sum(1), torch.ones(T), rtol=0, atol=1e-5)
        torch.testing.assert_close(res.weights, picked / picked.sum(1, keepdim=True))
    else:
        torch.testing.assert_close(res.weights, picked)


@given(cfg=configs(grouped=True), T=tokens, seed=seeds)
def test_group_limits_hold(cfg, T, seed):
    r = _router(seed, **cfg)
    x = _x(T, seed)
    res = r(x)
    E, G = cfg["num_experts"], cfg["n_groups"]
    per_group = E // G
    s_TGX = _scores(r, x).view(T, G, per_group)
    group_TG = s_TGX.topk(min(2, per_group), dim=-1).values.sum(-1)
    kth_best_T = group_TG.topk(cfg["topk_groups"], dim=-1).values[:, -1]
    for t, row in enumerate(res.expert_idx.tolist()):
        groups = {e // per_group for e in row}
        assert len(groups) <= cfg["topk_groups"]
        for g in groups:  # only the best groups may be used (top-2 sum per group, as DeepSeek-V3)
            assert float(group_TG[t, g]) >= float(kth_best_T[t]) - 1e-6


def test_group_score_is_the_sum_of_the_two_best_scores():
    r = TopKRouter(RouterConfig(dim=D, num_experts=4, n_groups=2, topk_groups=1, score_func="sigmoid"))
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 0] = torch.tensor([0.9, 0.01, 0.55, 0.5]).logit()  # scores of a token with x = e_0
    x = torch.zeros(1, D)
    x[0, 0] = 1.0
    # expert 0 is the best overall, but group 1 wins on its top-2 sum (1.05 > 0.91)
    assert r(x).expert_idx.tolist() == [[2]]


@given(cfg=configs(grouped=True), T=tokens, cf=st.floats(0.1, 2.0), seed=seeds)
def test_capacity_is_never_exceeded_and_drops_are_the_lowest_scored(cfg, T, cf, seed):
    capped, dropless = _router(seed, capacity_factor=cf, **cfg), _router(seed, **cfg)
    x = _x(T, seed)
    res, full = capped(x), dropless(x)
    E, K = cfg["num_experts"], cfg["top_k"]
    _check_result(res, T, K, E)
    cap = math.ceil(cf * T * K / E)
    kept = res.expert_idx >= 0
    # capacity only drops slots, it never re-routes one or changes a kept weight
    assert torch.equal(res.expert_idx[kept], full.expert_idx[kept])
    torch.testing.assert_close(res.weights[kept], full.weights[kept])
    for e in range(E):
        mine = full.expert_idx == e
        assert int(res.counts[e]) == min(cap, int(mine.sum()))
        kept_w, dropped_w = full.weights.detach()[mine & kept], full.weights.detach()[mine & ~kept]
        if kept_w.numel() and dropped_w.numel():
            assert float(kept_w.min()) >= float(dropped_w.max())
    assert res.stats.dropped_fraction == pytest.approx(float((~kept).sum()) / max(T * K, 1))


def test_capacity_ties_go_to_the_lowest_token_index():
    r = TopKRouter(RouterConfig(dim=D, num_experts=1, capacity_factor=0.4))  # capacity ceil(0.4 * 5) = 2
    res = r(_x(5))  # one expert, every gate is 1.0: all five slots tie
    assert res.expert_idx[:, 0].tolist() == [0, 0, -1, -1, -1]
    assert res.weights[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


@given(cfg=configs(grouped=True), T=tokens, seed=seeds)
def test_dropless_drops_nothing(cfg, T, seed):
    res = _router(seed, **cfg)(_x(T, seed))
    assert bool((res.expert_idx >= 0).all())
    assert int(res.counts.sum()) == T * cfg["top_k"]
    assert res.stats.dropped_fraction == 0.0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_bias_changes_selection_but_not_gate_values(score_func, renormalize):
    r = _router(3, num_experts=5, top_k=2, score_func=score_func, renormalize=renormalize)
    x = _x(12, 3)
    before = r(x)
    assert not bool((before.expert_idx == 4).any(dim=1).all()), "pick data where expert 4 is not always chosen"
    r.bias[4] = 10.0
    res = r(x)
    assert bool((res.expert_idx == 4).any(dim=1).all())
    picked = _scores(r, x).gather(1, res.expert_idx)  # unbiased scores at the chosen experts
    expected = picked / picked.sum(1, keepdim=True) if renormalize else picked
    torch.testing.assert_close(res.weights, expected)


def _skewed_x(T, seed=0):
    """Inputs whose feature 0 is a constant 1, so a gate weight on it favours one expert for all tokens."""
    x = _x(T, seed)
    x[:, 0] = 1.0
    return x


def test_bias_update_moves_toward_balance():
    rate = 0.01
    r = _router(1, num_experts=4, top_k=1, bias_update_rate=rate)
    with torch.no_grad():
        r.weight[0, 0] = 5.0  # expert 0 takes (almost) every token
    x = _skewed_x(32)
    r.eval()
    r(x)
    assert torch.equal(r.bias, torch.zeros(4)), "no update in eval mode"
    r.train()
    first = r(x)
    load = first.counts.float()
    assert float(load[0]) > 8
    expected = rate * torch.sign(load.mean() - load)
    torch.testing.assert_close(r.bias, expected)
    assert float(r.bias[0]) < 0
    first.weights.sum().backward()  # the in-place update stays outside autograd
    assert not r.bias.requires_grad and "bias" not in dict(r.named_parameters())
    for _ in range(400):
        last = r(x)
    assert last.stats.max_load < first.stats.max_load


def test_no_bias_update_when_rate_is_zero():
    r = _router(1, num_experts=4, top_k=2)
    r.train()
    r(_skewed_x(16))
    assert torch.equal(r.bias, torch.zeros(4))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("cf", [None, 0.5])
def test_losses_match_the_loss_functions(score_func, cf):
    kw = dict(num_experts=5, top_k=2, score_func=score_func, aux_loss_coef=0.01, seq_aux_loss_coef=0.1)
    r, dropless = _router(2, capacity_factor=cf, z_loss_coef=1e-3, **kw), _router(2, **kw)
    x = _x(12, 2)
    res = r(x, seq_len=4)
    logits = x @ r.weight.T
    probs = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
    idx = dropless(x, seq_len=4).expert_idx  # the losses see the selection before capacity drops
    expected = 0.01 * load_balancing_loss(probs, idx, 5) + 0.1 * sequence_load_balancing_loss(probs, idx, 5, 4)
    torch.testing.assert_close(res.aux_loss, expected)
    torch.testing.assert_close(res.z_loss, 1e-3 * router_z_loss(logits))
    (res.weights.sum() + res.aux_loss + res.z_loss).backward()
    assert r.weight.grad is not None and bool(r.weight.grad.abs().sum() > 0)


@pytest.mark.parametrize("coef", [1.0, 0.01])
def test_switch_aux_loss_equals_coef_with_uniform_probs(coef):
    r = TopKRouter(RouterConfig(dim=D, num_experts=4, top_k=2, aux_loss_coef=coef))
    with torch.no_grad():
        r.weight.zero_()  # uniform probabilities: E * sum_e f_e / E = 1 for any dropless selection
    assert r(_x(10)).aux_loss.item() == pytest.approx(coef, rel=1e-6)


def test_zero_coefficients_give_zero_losses():
    res = _router(0, num_experts=4, top_k=2)(_x(8), seq_len=4)
    assert res.aux_loss.item() == 0.0 and res.z_loss.item() == 0.0


@pytest.mark.parametrize("T", [0, 1, 3])
@pytest.mark.parametrize("cf", [None, 1.0])
def test_tiny_batches(T, cf):
    cfg = dict(
        num_experts=6, top_k=2, n_groups=3, topk_groups=2, capacity_factor=cf, aux_loss_coef=0.1, z_loss_coef=0.1
    )
    r = _router(0, bias_update_rate=0.1, **cfg).train()
    res = r(_x(T), seq_len=1 if T else None)
    _check_result(res, T, 2, 6)
    assert torch.isfinite(res.aux_loss) and torch.isfinite(res.z_loss)


def test_bf16_input_routes_in_fp32():
    r = _router(4, num_experts=5, top_k=2)
    x = _x(9, 4).bfloat16()
    res, ref = r(x), r(x.float())
    assert res.weights.dtype == torch.float32
    assert torch.equal(res.expert_idx, ref.expert_idx) and torch.equal(res.weights, ref.weights)
    res16 = r.bfloat16()(x)  # a bf16 gate is upcast too
    _check_result(res16, 9, 2, 5)


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(D), r"x must have shape \(T, D=6\), got \(6,\)"),
        (torch.randn(3, D + 1), r"x must have shape \(T, D=6\), got \(3, 7\)"),
        (torch.randn(2, 3, D), r"x must have shape \(T, D=6\), got \(2, 3, 6\)"),
        (torch.ones(3, D, dtype=torch.long), r"x must be a floating-point tensor, got dtype torch.int64"),
        (torch.tensor([[0.0] * (D - 1) + [float("nan")]]), r"x must be finite: found NaN"),
        ([[0.0] * D], r"x must be a torch.Tensor"),
    ],
)
def test_bad_x_raises_value_error(x, match):
    with pytest.raises(ValueError, match=match):
        _router(0, num_experts=3)(x)


def test_seq_len_is_required_by_the_sequence_loss_and_must_divide_T():
    r = _router(0, num_experts=3, seq_aux_loss_coef=0.1)
    with pytest.raises(ValueError, match=r"seq_len must be given when seq_aux_loss_coef > 0"):
        r(_x(6))
    with pytest.raises(ValueError, match=r"seq_len must divide the number of tokens T = 6, got seq_len = 4"):
        r(_x(6), seq_len=4)
    with pytest.raises(ValueError, match=r"seq_len must be None or an int >= 1, got 0"):
        r(_x(6), seq_len=0)


def test_stats_are_computed_when_read_and_match_numpy():
    # the floats cost host reads, so they are made on first read; until then only the counts
    # and a device scalar are kept
    from ..host_reads import HostReads

    r = _router(3, num_experts=5, top_k=2, capacity_factor=0.8)
    x = _x(23, 3)
    with HostReads(x, r.weight) as seen:
        res = r(x)
        before = list(seen.reads)
        stats = res.stats
        assert seen.reads == before  # building the stats read nothing
        values = (stats.max_load, stats.load_cv, stats.dropped_fraction, stats.entropy)
        assert len(seen.reads) > len(before)
        assert (stats.max_load, stats.load_cv, stats.dropped_fraction, stats.entropy) == values  # computed once
    c = res.counts.double().numpy()
    p = _scores(r, x).double().numpy()
    entropy = float(-(p * np.log(p)).sum(1).mean())
    dropped = (res.expert_idx < 0).sum().item() / (23 * 2)
    assert dropped > 0  # the capacity dropped some slots
    assert values == pytest.approx((c.max() / c.mean(), c.std() / c.mean(), dropped, entropy), rel=1e-6)
    assert repr(stats).startswith("RoutingStats(max_load=")
