"""Megatron-core: weight conversion against a real Megatron ``MoELayer`` built on CPU, our
layer in its MLP slot, and a Megatron GPT with our MoE under TP, SP, PP and EP against one
process (tests/adapters/megatron_layouts.py; CPU shims in tests/adapters/megatron_cpu.py)."""

from __future__ import annotations

import importlib.util

import pytest

# looked up, not imported: importing Megatron takes seconds, and only the launched ranks need it
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs the megatron extra: pip install 'moe[megatron]'", allow_module_level=True)

import os  # noqa: E402
import traceback  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.adapters import megatron_cpu, megatron_layouts  # noqa: E402
from tests.parallel import launch  # noqa: E402

D, FF, E, K = 16, 24, 4, 2


def _megatron_layer():
    """Megatron's MoELayer (SequentialMLP experts) built on CPU in a one-rank gloo group. Its
    all-gather token dispatcher is chosen because the all-to-all one makes a CUDA stream when
    built."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    cfg = megatron_cpu.moe_layer_config(dim=D, hidden=FF, experts=E, top_k=K, moe_aux_loss_coeff=0.01)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    torch.manual_seed(0)
    return cfg, MoELayer(cfg, spec.submodules.mlp.submodules)


def _megatron_expert(sd: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Megatron's SequentialMLP expert e with SwiGLU: fc2(silu(gate) * up), [gate | up] = fc1(x)."""
    gate, up = torch.chunk(F.linear(x, sd[f"experts.local_experts.{e}.linear_fc1.weight"]), 2, dim=-1)
    return F.linear(F.silu(gate) * up, sd[f"experts.local_experts.{e}.linear_fc2.weight"])


def _conversion():
    from moe.adapters.megatron import from_megatron_state_dict, moe_config_from_megatron, to_megatron_state_dict

    cfg, meg = _megatron_layer()
    sd = {k: v for k, v in meg.state_dict().items() if not k.endswith("_extra_state")}
    moe_cfg = moe_config_from_megatron(cfg, backend="torch")
    assert (moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.hidden_dim, moe_cfg.aux_loss_coef) == (E, K, FF, 0.01)
    ours = from_megatron_state_dict(sd, moe_cfg)
    x = torch.randn(5, D)
    for e in range(E):  # each expert computes what Megatron's does
        counts = torch.zeros(E, dtype=torch.long)
        counts[e] = x.shape[0]
        w = [getattr(ours.experts, n).detach() for n in ("w1", "w3", "w2")]
        mine = (F.silu(x @ w[0][e]) * (x @ w[1][e])) @ w[2][e]
        torch.testing.assert_close(mine, _megatron_expert(sd, e, x))
    torch.testing.assert_close(ours.router.weight, sd["router.weight"])
    back = to_megatron_state_dict(ours, layout="sequential")  # exactly Megatron's keys and values
    assert set(back) == set(sd)
    for k in sd:
        torch.testing.assert_close(back[k], sd[k], rtol=0, atol=0, msg=k)
    meg.load_state_dict(back, strict=False)  # and Megatron's layer takes them back
    x_sbh = torch.randn(6, 3, D)  # the whole layers agree: Megatron's forward against ours
    with torch.no_grad():
        torch.testing.assert_close(meg(x_sbh)[0], ours(x_sbh.transpose(0, 1)).transpose(0, 1))
    for layout in ("grouped", "te_grouped"):  # the other layouts round-trip to the same layer
        other = to_megatron_state_dict(ours, layout=layout, prefix="decoder.layers.0.mlp.")
        again = from_megatron_state_dict(other, moe_cfg, prefix="decoder.layers.0.mlp.")
        for (n, p), q in zip(ours.named_parameters(), again.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{layout}: {n}")
    grouped = to_megatron_state_dict(ours, layout="grouped")
    w1 = grouped["experts.weight1"].view(E, D, -1)  # how Megatron's GroupedMLP reads weight1
    w2 = grouped["experts.weight2"].view(E, -1, D)
    for e in range(E):
        gate, up = torch.chunk(x @ w1[e], 2, dim=-1)
        torch.testing.assert_close((F.silu(gate) * up) @ w2[e], _megatron_expert(sd, e, x))


def _slot():
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.spec_utils import build_module

    from moe import MoE, aux_loss
    from moe.adapters.megatron import moe_config_from_megatron, moe_module_spec

    cfg, _ = _megatron_layer()
    torch.manual_seed(1)
    slot = build_module(moe_module_spec(moe_config_from_megatron(cfg, backend="torch")), config=cfg)
    ref = MoE(slot.moe.config)
    ref.load_state_dict(slot.moe.state_dict())
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) * 0.5)  # as Megatron's schedules set it
    x_sbh = torch.randn(6, 3, D)
    y, bias = slot(x_sbh)
    assert bias is None and y.shape == x_sbh.shape
    y.square().sum().backward()
    y_ref = ref(x_sbh.transpose(0, 1)).transpose(0, 1)
    (y_ref.square().sum() + 0.5 * aux_loss(ref)).backward()
    torch.testing.assert_close(y, y_ref)
    for (n, p), q in zip(slot.moe.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


CHECKS = {
    "conversion": _conversion,
    "slot": _slot,
    **{
        f"layout-{megatron_layouts.layout_id(lay)}": partial(megatron_layouts.check_layout, i)
        for i, lay in enumerate(megatron_layouts.LAYOUTS)
    },
    "groups": megatron_layouts.groups_and_bad_layouts,
}


def _run_checks(rank, world, store, out_dir):
    """Every check of this file in one 2-rank launch (importing Megatron is most of the cost
    of a launch). Each rank writes each check's traceback ("" when it passed); after a failure
    on any rank the launch stops, since the ranks may then no longer meet in the same
    collectives. The one-rank checks run on both ranks, with no collective."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    launch.init(rank, world, store)
    megatron_cpu.install()
    for name, check in CHECKS.items():
        try:
            check()
            error = ""
        except Exception:
            error = traceback.format_exc()
        finally:  # the next check starts from no Megatron state
            parallel_state.destroy_model_parallel()
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
        with open(os.path.join(out_dir, f"{name}.{rank}"), "w") as f:
            f.write(error)
        failed = torch.tensor([float(bool(error))])
        dist.all_reduce(failed)
        if failed.item():
            break


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    launch.spawn(_run_checks, 2, str(out))
    return out


def _expect_passed(results, name: str) -> None:
    got = {r: (results / f"{name}.{r}").read_text() for r in range(2) if (results / f"{name}.{r}").exists()}
    if len(got) < 2:
        pytest.fail(f"{name}: not run on every rank (an earlier check failed, see it)")
    errors = [f"rank {r}:\n{e}" for r, e in got.items() if e]
    if errors:
        pytest.fail(f"{name} failed\n" + "\n".join(errors), pytrace=False)


@pytest.mark.distributed
def test_megatron_weights_convert_both_ways(results):
    _expect_passed(results, "conversion")


@pytest.mark.distributed
def test_megatron_mlp_slot_returns_output_and_no_bias_with_the_aux_loss_scaled(results):
    _expect_passed(results, "slot")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", megatron_layouts.LAYOUTS, ids=megatron_layouts.layout_id)
def test_megatron_gpt_layout_gives_the_one_process_losses_and_gradients(results, layout):
    """TP2, TP2+SP (experts split over etp = tp, and replicated), PP2 (1F1B), EP2, EP2 under
    SP, EP2 with global BASE and TP2+SP under full recompute against one process: losses and every gradient (fp32, rtol
    1e-5), router losses included (see megatron_layouts.LAYOUTS)."""
    _expect_passed(results, f"layout-{megatron_layouts.layout_id(layout)}")


@pytest.mark.distributed
def test_megatron_moe_takes_a_pg_collection_and_refuses_layouts_it_cannot_run(results):
    _expect_passed(results, "groups")
