"""Config validation: a config that can never run is refused at construction, with a message
naming the field; types count (bools are bools, ints are ints and not bools, floats finite)."""

import math

import numpy as np
import pytest
import torch

from moe import MoE, MoEConfig, RouterConfig

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"backend": "ref"}, r"backend must be one of \('auto', 'triton', 'torch'\), got 'ref'"),
        ({"capacity_factor": INF}, r"capacity_factor must be None or a finite number > 0, got inf"),
        ({"capacity_factor": NAN}, r"capacity_factor must be None or a finite number > 0, got nan"),
        ({"capacity_factor": 0.0}, r"capacity_factor .* > 0, got 0.0"),
        ({"top_k": 1.5}, r"top_k must be an int in \[1, 4\], got 1.5"),
        ({"top_k": True}, r"top_k must be an int in \[1, 4\], got True"),
        ({"num_experts": 4.0}, r"num_experts must be an int >= 1, got 4.0"),
        ({"dim": "32"}, r"dim must be an int >= 1, got '32'"),
        ({"hidden_dim": 0}, r"hidden_dim must be an int >= 1, got 0"),
        ({"num_shared_experts": 1, "shared_hidden_dim": 0}, r"shared_hidden_dim must be None or an int >= 1, got 0"),
        ({"num_shared_experts": 1, "shared_hidden_dim": -4}, r"shared_hidden_dim .* got -4"),
        ({"num_shared_experts": 1.0}, r"num_shared_experts must be an int >= 0, got 1.0"),
        ({"router_options": {"bias_update_rate": INF}}, r"bias_update_rate must be a finite number >= 0, got inf"),
        ({"fused": "no"}, r"fused must be a bool, got 'no'"),
        ({"fused": 1}, r"fused must be a bool, got 1"),
        ({"aux_loss_coef": INF}, r"aux_loss_coef must be a finite number >= 0, got inf"),
        ({"z_loss_coef": -1e-3}, r"z_loss_coef must be a finite number >= 0"),
        ({"router": "Top-K"}, r"router must be one of .*, got 'Top-K'"),
        ({"activation": None}, r"activation must be one of .*, got None"),
        ({"router_options": [("score_func", "sigmoid")]}, r"router_options must be a dict"),
        ({"router_options": {"top_k": 1}}, r"router_options must not set \['top_k'\]"),
        ({"router_options": {"renormalize": "yes"}}, r"renormalize must be a bool, got 'yes'"),
        ({"router_options": {"sinkhorn_iters": 2.0}}, r"sinkhorn_iters must be an int >= 1, got 2.0"),
        ({"router_options": {"sinkhorn_temperature": INF}}, r"sinkhorn_temperature must be a finite number > 0"),
        ({"router_options": {"base_max_iters": False}}, r"base_max_iters must be None or an int >= 0, got False"),
        ({"router_options": {"n_groups": 2.0}}, r"n_groups must be an int >= 1, got 2.0"),
        ({"router_options": {"seq_aux_loss_coef": NAN}}, r"seq_aux_loss_coef must be a finite number >= 0"),
    ],
)
def test_layer_config_refuses_what_cannot_run(overrides, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_name("tiny", **overrides)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"dim": 8.0}, r"dim must be an int >= 1, got 8.0"),
        ({"num_experts": True}, r"num_experts must be an int >= 1, got True"),
        ({"top_k": 5}, r"top_k must be an int in \[1, 4\], got 5"),
        ({"kind": "sparse"}, r"kind must be one of"),
        ({"score_func": "relu"}, r"score_func must be one of \('softmax', 'sigmoid'\)"),
        ({"capacity_factor": INF}, r"capacity_factor must be None or a finite number > 0, got inf"),
        ({"bias_update_rate": NAN}, r"bias_update_rate must be a finite number >= 0, got nan"),
        ({"topk_groups": 1.0}, r"topk_groups must be an int in \[1, 1\], got 1.0"),
        ({"base_solver": "auction"}, r"base_solver must be one of \('exact', 'approx'\)"),
    ],
)
def test_router_config_refuses_what_cannot_run(overrides, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**{"dim": 8, "num_experts": 4, **overrides})


def test_numpy_integers_and_integral_floats_where_a_float_is_wanted_are_accepted():
    cfg = MoEConfig(dim=np.int64(32), hidden_dim=48, num_experts=4, top_k=np.int32(2), capacity_factor=1)
    layer = MoE(cfg)
    assert layer(torch.randn(5, 32)).shape == (5, 32)
    assert RouterConfig(dim=8, num_experts=4, bias_update_rate=np.float64(0.01)).bias_update_rate == 0.01


def test_every_preset_is_valid_and_replace_revalidates():
    import dataclasses

    for name in ("mixtral-8x7b", "deepseek-v3", "llama2-7b-base", "tiny", "tiny-base"):
        cfg = MoEConfig.from_name(name)
        with pytest.raises(ValueError, match="top_k must be an int"):
            dataclasses.replace(cfg, top_k=float(cfg.top_k))
