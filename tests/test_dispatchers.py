"""The layer's dispatcher seam: the one-device dispatcher follows the config, holds no state,
and a dispatcher set from outside takes every step between routing and combining (its token
gather and scatter, its failure relay and its loss scale included)."""

import copy

import pytest
import torch

from moe import MoE, MoEConfig, aux_loss
from moe.dispatchers import Dispatcher, FusedDispatcher, LocalDispatcher


def make(name="tiny", **overrides):
    torch.manual_seed(0)
    return MoE(MoEConfig.from_name(name, **overrides))


class TwoRanksInOne(LocalDispatcher):
    """Stands for two ranks that route the same tokens together (as etp ranks do): the tokens
    routed are this rank's twice over, the outputs and gates come back as the first copy's rows,
    and the router's loss counts half. Records the steps it is asked for."""

    local = False
    loss_scale = 0.5

    def __init__(self) -> None:
        self.steps, self.n = [], None

    def check_input(self, layer, x, seq_len=None):
        self.steps.append("check_input")

    def gather_tokens(self, x_TD):
        self.steps.append("gather_tokens")
        self.n = x_TD.shape[0]
        return torch.cat([x_TD, x_TD])

    def fail(self, layer, err):
        self.steps.append("fail")
        raise err

    def __call__(self, layer, x_TD, routing, gates_TK):
        self.steps.append("call")
        assert gates_TK.dtype == x_TD.dtype and gates_TK.shape == routing.expert_idx.shape
        return super().__call__(layer, x_TD, routing, gates_TK)

    def scatter_tokens(self, y_TD):
        self.steps.append("scatter_tokens")
        return y_TD[: self.n]

    def local_rows(self, t):
        self.steps.append("local_rows")
        return t[: self.n]


@pytest.mark.parametrize("fused", [False, True])
def test_the_one_device_dispatcher_follows_the_config_and_holds_no_state(fused):
    layer = make("tiny-base", fused=fused)
    assert type(layer.dispatcher) is (FusedDispatcher if fused else LocalDispatcher)
    assert layer.parallel is None and isinstance(layer.dispatcher, Dispatcher)
    keys = list(layer.state_dict())
    layer.dispatcher = TwoRanksInOne()
    assert list(layer.state_dict()) == keys  # checkpoints do not see which dispatcher runs
    assert layer.parallel is layer.dispatcher
    with pytest.raises(AttributeError):
        layer.parallel = LocalDispatcher()  # the dispatcher is set, `parallel` only reads it


@pytest.mark.parametrize("combine", ["weighted", "sigmoid_residual"])
def test_a_dispatcher_set_from_outside_takes_every_step_between_routing_and_combining(combine):
    """Top-k routes each token alone, so routing the tokens twice over gives each the same
    experts: the output is the plain layer's, the residual mix and shared experts run on this
    rank's rows, and the router's loss is counted at the dispatcher's scale."""
    opts = {"router": "topk", "top_k": 1, "combine": combine, "num_shared_experts": 1, "aux_loss_coef": 0.01}
    ref = make("tiny", **opts)
    layer = copy.deepcopy(ref)
    layer.dispatcher = spy = TwoRanksInOne()
    x = torch.randn(2, 7, 32)
    y, y_ref = layer(x), ref(x)
    assert spy.steps == ["check_input", "gather_tokens", "call", "scatter_tokens", "local_rows"]
    torch.testing.assert_close(y, y_ref)
    assert layer.last_routing.expert_idx.shape[0] == 28  # the layer routed what the dispatcher gathered
    torch.testing.assert_close(aux_loss(layer), 0.5 * aux_loss(ref))

    spy.steps.clear()
    with pytest.raises(ValueError, match="finite"):
        layer(torch.full((3, 32), float("nan")))
    assert spy.steps == ["check_input", "gather_tokens", "fail"]  # the router's error goes through fail
