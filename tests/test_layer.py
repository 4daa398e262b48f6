"""The MoE layer: shape, the per-token definition, BASE's train/eval and residual mix, losses,
meta-device construction and bad input."""

import pytest
import torch
import torch.nn.functional as F

import moe
from moe import MoE, MoEConfig, aux_loss
from moe.routing import expert_capacities


def make(name="tiny", **overrides):
    torch.manual_seed(0)
    return MoE(MoEConfig.from_name(name, **overrides))


def naive(layer: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """The definition, token by token: sum_j gate_j * expert_{e_j}(x) (+ shared experts)."""
    res = layer.last_routing
    ex = layer.experts
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for j in range(res.expert_idx.shape[1]):
            e = int(res.expert_idx[t, j])
            if e < 0:
                continue
            h = F.silu(x_TD[t] @ ex.w1[e]) * (x_TD[t] @ ex.w3[e])
            out[t] += res.weights[t, j] * (h @ ex.w2[e])
    if layer.config.combine == "sigmoid_residual":
        out += (1 - res.weights.sum(1, keepdim=True)) * x_TD
    if layer.shared is not None:
        out += layer.shared(x_TD)
    return out


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tiny", {}),
        ("tiny", {"router": "sinkhorn"}),
        ("tiny", {"router": "expert_choice"}),
        ("tiny", {"capacity_factor": 1.0}),
        ("tiny", {"num_shared_experts": 2, "shared_hidden_dim": 16}),
        ("tiny-base", {}),
        ("tiny", {"fused": True, "capacity_factor": 1.0}),
        ("tiny-base", {"fused": True}),
    ],
)
def test_matches_the_per_token_definition(name, overrides):
    layer = make(name, **overrides)
    x = torch.randn(3, 7, 32)  # (batch, seq, D): T = 21 is not a multiple of E
    y = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(-1, 32), naive(layer, x.reshape(-1, 32)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_fused_layer_equals_unfused_with_gradients(backend):
    layers = [make("tiny", fused=fused, backend=backend, capacity_factor=1.0) for fused in (False, True)]
    x = torch.randn(19, 32)
    leaves = [x.clone().requires_grad_() for _ in layers]
    for layer, xx in zip(layers, leaves, strict=True):
        (layer(xx) * torch.linspace(-1, 1, 32)).sum().backward()
    torch.testing.assert_close(leaves[1].grad, leaves[0].grad, rtol=1e-4, atol=1e-5)
    params = dict(layers[1].named_parameters())
    for name, p in layers[0].named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_routes_and_reports_once(reentrant):
    """A checkpointed layer (its forward re-run in the backward) gives the plain layer's gradients;
    the aux-loss-free bias moves once and the aux loss is collected once. (Reentrant checkpointing
    runs the first forward without autograd, so the aux loss can carry no gradient there.)"""
    from torch.utils.checkpoint import checkpoint

    opts = {"router_options": {"bias_update_rate": 0.1}, "aux_loss_coef": 0.0 if reentrant else 0.01}
    layers = [make("tiny", **opts) for _ in range(2)]
    x = torch.randn(2, 9, 32)
    leaves = [x.clone().requires_grad_() for _ in layers]
    outs = [layers[0](leaves[0]), checkpoint(layers[1], leaves[1], use_reentrant=reentrant)]
    for layer, out in zip(layers, outs, strict=True):
        (out.square().sum() + aux_loss(layer)).backward()
        assert layer._pending_loss is None  # nothing left over from the re-run
    torch.testing.assert_close(leaves[1].grad, leaves[0].grad)
    torch.testing.assert_close(layers[1].router.bias, layers[0].router.bias)
    assert layers[0].router.bias.abs().sum() > 0
    params = dict(layers[1].named_parameters())
    for name, p in layers[0].named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


class _Attach(torch.autograd.Function):
    """The aux-loss scaler the adapters use: identity on y; the loss gets gradient 1."""

    @staticmethod
    def forward(ctx, y, loss):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, torch.ones((), device=grad_y.device)


def _save_matmuls(ctx, func, *args, **kwargs):
    """A selective-checkpointing policy in the style of torchtitan's: keep matmul outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.linear.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "selective"])
def test_router_losses_attached_inside_a_checkpoint_reach_the_gradients_once(mode):
    """The adapters' pattern, ``attach(layer(x), aux_loss(layer))`` inside the checkpointed
    region: the gradients equal the plain run's (the losses count once, through the re-run
    under reentrant checkpointing, which runs the first forward without autograd), and the
    forwards' own sum still counts each forward once."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    opts = {"aux_loss_coef": 0.5, "z_loss_coef": 0.1}
    layers = [make("tiny", **opts) for _ in range(2)]

    def block(layer, x):
        y = layer(x)
        loss = aux_loss(layer)
        return _Attach.apply(y, loss) if loss.requires_grad and torch.is_grad_enabled() else y

    x = torch.randn(2, 9, 32)
    leaves = [x.clone().requires_grad_() for _ in layers]
    kwargs = {"use_reentrant": mode == "reentrant"}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    outs = [block(layers[0], leaves[0]), checkpoint(block, layers[1], leaves[1], **kwargs)]
    for out in outs:
        out.square().sum().backward()
    assert layers[0].router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(leaves[1].grad, leaves[0].grad)
    params = dict(layers[1].named_parameters())
    for name, p in layers[0].named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    for layer in layers:
        assert layer._pending_loss is None and layer._rerun_loss is None  # nothing left for a later step


def test_a_rerun_loss_nobody_collects_is_dropped_when_the_backward_ends():
    """aux_loss collected after the forward (outside the checkpoint): the re-run's losses wait
    for a call in the backward that never comes, and the backward's end drops them."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    layer = make("tiny", aux_loss_coef=0.5)
    with set_checkpoint_early_stop(False):  # the re-run goes on past the last saved tensor, to the loss
        y = checkpoint(layer, torch.randn(9, 32, requires_grad=True), use_reentrant=False)
    loss = y.square().sum() + aux_loss(layer)
    seen = []
    layer.router.weight.register_hook(lambda g: seen.append(layer._rerun_loss is not None))  # after the re-run
    loss.backward()
    assert seen == [True] and layer._rerun_loss is None


def test_base_balances_in_training_and_routes_greedily_in_eval():
    layer = make("tiny-base")
    x = torch.randn(22, 32)
    layer(x)
    assert torch.equal(layer.last_routing.counts.sort(descending=True).values, expert_capacities(22, 4, 1))
    layer.eval()
    layer(x)
    logits = x @ layer.router.weight.detach().T
    assert torch.equal(layer.last_routing.expert_idx[:, 0], logits.argmax(1))


def test_gradients_reach_router_and_experts_and_aux_loss_is_collected_once():
    layer = make("tiny", aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(16, 32, requires_grad=True)
    loss = layer(x).square().mean() + aux_loss(layer)
    assert aux_loss(layer).item() == 0.0  # collected: nothing left for a second call
    loss.backward()
    for p in (x, layer.router.weight, layer.experts.w1, layer.experts.w2, layer.experts.w3):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert layer.last_routing.weights.grad_fn is None  # the kept copy holds no graph


def test_kept_memory_changes_no_result_and_is_released():
    from moe.kernels import workspace

    layer = make("tiny", dim=256, hidden_dim=512, num_experts=4, top_k=2, router="topk", combine="weighted")
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    moe.release_work_buffers()
    results = []
    for _ in range(3):  # first step in fresh memory, then twice in the memory kept from before
        xg = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = layer(xg)
        (y * torch.linspace(-1, 1, 256)).sum().backward()
        results.append([y.detach().clone(), xg.grad.clone(), layer.experts.w1.grad.clone()])
        assert workspace.kept_bytes() > 0
    for later in results[1:]:
        for a, b in zip(results[0], later, strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(results[0][0], torch.zeros_like(results[0][0]))
    moe.release_work_buffers()
    assert workspace.kept_bytes() == 0


def test_bf16_and_empty_input():
    layer = make("tiny").to(torch.bfloat16)
    y = layer(torch.randn(2, 5, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert layer(torch.randn(0, 32, dtype=torch.bfloat16)).shape == (0, 32)


def test_meta_construction_then_reset_parameters():
    with torch.device("meta"):
        layer = MoE(MoEConfig.from_name("tiny", num_shared_experts=1))
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    y = layer(torch.randn(9, 32))
    assert torch.isfinite(y).all() and all(torch.isfinite(p).all() for p in layer.parameters())


def test_presets_and_bad_config():
    for name in ("mixtral-8x7b", "deepseek-v3", "llama2-7b-base", "tiny", "tiny-base"):
        assert MoEConfig.from_name(name).router_config().num_experts >= 1
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(dim=8, hidden_dim=8, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="sigmoid_residual"):
        MoEConfig(dim=8, hidden_dim=8, num_experts=4, top_k=2, combine="sigmoid_residual")
    with pytest.raises(ValueError, match="router_options"):
        MoEConfig(dim=8, hidden_dim=8, num_experts=4, router_options={"temperature": 2})
    with pytest.raises(ValueError, match="unknown preset"):
        MoEConfig.from_name("gpt-5")


def test_bad_input_raises():
    layer = make("tiny")
    with pytest.raises(ValueError, match="finite"):
        layer(torch.full((4, 32), float("nan")))
    with pytest.raises(ValueError, match=r"\(\.\.\., D=32\)"):
        layer(torch.randn(4, 31))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_aux_loss_sums_every_forward_since_the_last_call(checkpointed):
    """Two forwards of one layer (gradient accumulation, or a layer used twice) both count, with
    their gradients; a checkpointed re-run in the backward adds nothing; nothing is left over."""
    from torch.utils.checkpoint import checkpoint

    opts = {"aux_loss_coef": 0.01, "z_loss_coef": 0.001}
    together, apart = make("tiny", **opts), make("tiny", **opts)
    xs = [torch.randn(9, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    run = (lambda layer, x: checkpoint(layer, x, use_reentrant=False)) if checkpointed else (lambda layer, x: layer(x))

    outs, seen = [], []
    for x in xs:
        outs.append(run(together, x))
        seen.append(together.last_routing.aux_loss + together.last_routing.z_loss)
    total = aux_loss(together)
    assert together._pending_loss is None and aux_loss(together).item() == 0.0
    torch.testing.assert_close(total.detach(), seen[0] + seen[1])
    assert not torch.equal(seen[0], seen[1])
    (sum(out.square().sum() for out in outs) + total).backward()
    assert together._pending_loss is None  # the re-runs in the backward reported nothing

    loss = 0
    for x in xs:  # the same forwards, each loss collected right after its forward
        loss = loss + run(apart, x).square().sum() + aux_loss(apart)
    loss.backward()
    grads = dict(apart.named_parameters())
    for name, p in together.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["tiny", "tiny-base"])
def test_deepcopy_after_a_training_forward_and_the_copy_behaves(name):
    import copy

    from torch.optim.swa_utils import AveragedModel

    layer = make(name, aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(11, 32)
    layer(x)  # leaves a pending loss that belongs to this forward's autograd graph
    twin = copy.deepcopy(layer)
    ema = AveragedModel(layer)  # deep-copies the layer too
    assert aux_loss(twin).item() == 0.0  # the copy ran no forward: nothing pending on it
    assert ema.module._pending_loss is None
    y, y_twin = layer(x), twin(x)
    torch.testing.assert_close(y_twin, y)
    (y_twin.square().sum() + aux_loss(twin)).backward()
    assert twin.router.weight.grad is not None and layer.router.weight.grad is None  # its own graph
    total = aux_loss(layer)  # the original still holds both of its forwards
    torch.testing.assert_close(total, 2 * (layer.last_routing.aux_loss + layer.last_routing.z_loss))
    ema.update_parameters(layer)
    for p, q in zip(ema.module.parameters(), layer.parameters(), strict=True):
        assert torch.equal(p, q)


def test_zero_dim_and_non_tensor_input_raise():
    layer = make("tiny")
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., D=32\), got \(\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., D=32\), got list"):
        layer([[0.0] * 32])
    with pytest.raises(ValueError, match=r"config must be a moe.MoEConfig, got RouterConfig"):
        MoE(MoEConfig.from_name("tiny").router_config())


@pytest.mark.parametrize("name, overrides", [("tiny", {"capacity_factor": 1.0}), ("tiny-base", {})])
def test_fused_layer_in_fp64_keeps_fp64_gradients(name, overrides):
    """The fused path's backward computes in fp64 for fp64 parameters, as the unfused path does:
    the two agree to fp64 rounding (an fp32 step anywhere would leave them ~1e-8 apart)."""
    layers = [make(name, fused=fused, **overrides).double() for fused in (False, True)]
    x = torch.randn(19, 32, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for _ in layers]
    for layer, xx in zip(layers, leaves, strict=True):
        (layer(xx) * torch.linspace(-1, 1, 32, dtype=torch.float64)).sum().backward()
    tight = {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(leaves[1].grad, leaves[0].grad, **tight)
    params = dict(layers[1].named_parameters())
    for pname, p in layers[0].named_parameters():
        assert params[pname].grad.dtype == torch.float64
        torch.testing.assert_close(params[pname].grad, p.grad, **tight, msg=lambda m, n=pname: f"{n}: {m}")
