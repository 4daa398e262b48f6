"""torchtitan's own trainer with our MoE in its Llama: one process against TP2 (SP), FSDP2 dp=2,
PP2 and EP2 on CPU with gloo, same losses and gradient norms over three steps.

The shims that make torchtitan run on CPU are in tests/adapters/titan_cpu.py, each commented
with what it replaces. Every layout starts from the same weights (a full state dict built once
from the same seed, loaded into each layout's shards) and sees the same global batches
(`titan_cpu.FixedBatches`)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

pytest.importorskip("torchtitan", reason="needs the torchtitan extra: pip install 'moe[torchtitan]'")

import torch  # noqa: E402

from moe import MoEConfig  # noqa: E402
from tests.adapters import titan_cpu  # noqa: E402
from tests.parallel import launch  # noqa: E402

STEPS = 3
LAYOUTS = {  # name: (world, ParallelismConfig fields)
    "one": (1, {}),
    "fsdp2": (2, {"data_parallel_shard_degree": 2}),
    "tp2_sp": (2, {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2, "enable_sequence_parallel": True}),
    "pp2": (
        2,
        {
            "data_parallel_shard_degree": 1,
            "pipeline_parallel_degree": 2,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 2,
        },
    ),
    "ep2": (2, {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2}),
}


def _moe(**overrides) -> MoEConfig:
    return MoEConfig(**{"dim": 48, "hidden_dim": 40, "num_experts": 4, "top_k": 2, **overrides})


def trainer_config(folder: str, parallelism: dict, moe: MoEConfig):
    """torchtitan's llama3 debug config, shrunk to a 4-block model with our MoE in blocks 1 and 3."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from moe.adapters.torchtitan import moe_model_spec

    tok, data = titan_cpu.write_assets(folder)
    cfg = llama3_debugmodel()
    spec = dataclasses.replace(cfg.model_spec, model=titan_cpu.tiny_llama3())
    cfg.model_spec = moe_model_spec(spec, moe, every=2, first=1)
    cfg.hf_assets_path = tok
    cfg.dataloader = titan_cpu.FixedBatches.Config(dataset_path=data)
    cfg.training.seq_len = 32
    cfg.training.local_batch_size = 4 // parallelism.get("data_parallel_shard_degree", 1)
    cfg.training.steps = STEPS
    cfg.training.disable_cuda_graphs = True
    cfg.training.mixed_precision_param = "float32"  # bf16 rounding would depend on the batch split
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.activation_checkpoint = None
    cfg.dump_folder = os.path.join(folder, "out")
    cfg.parallelism.spmd_backend = "partial_dtensor"
    for k, v in parallelism.items():
        setattr(cfg.parallelism, k, v)
    return cfg


def reference_state(cfg) -> dict:
    """The full weights every layout starts from: the model built and initialised by
    torchtitan's init path in one process, from seed 0."""
    torch.manual_seed(0)
    model = cfg.model_spec.model.build()
    with torch.no_grad():
        model.init_states()
    # named tensors, not state_dict(): the fused QKV projection's state-dict hooks rename its weight
    # (non-persistent buffers, the RoPE cache, are rebuilt for the trainer's sequence length)
    persistent = set(model.state_dict())
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    return {k: v.detach().clone() for k, v in tensors}


@torch.no_grad()
def load_full(part: torch.nn.Module, full: dict) -> set[str]:
    """Copy the full weights into a layout's (possibly sharded) parameters and buffers."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    names = set()
    buffers = [(n, b) for n, b in part.named_buffers() if n in full]
    for name, t in [*part.named_parameters(), *buffers]:
        if name not in full:
            raise KeyError(f"{name} is not in the reference weights")
        src = full[name]
        if isinstance(t, DTensor):
            t.to_local().copy_(distribute_tensor(src, t.device_mesh, t.placements).to_local())
        else:
            t.copy_(src)
        names.add(name)
    return names


def _train(rank: int, world: int, store: str, layout: str, folder: str, moe: MoEConfig) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    titan_cpu.install()
    launch.init(rank, world, store)
    cfg = trainer_config(os.path.join(folder, f"r{rank}"), LAYOUTS[layout][1], moe)
    full = reference_state(cfg)
    trainer = cfg.build()
    titan_cpu.adapt_schedule(trainer)
    loaded = set()
    for part in trainer.model_parts:
        loaded |= load_full(part, full)
    from torch.distributed.tensor import DTensor

    from moe.adapters.torchtitan import MoEFeedForward

    w1 = [m.moe.experts.w1 for part in trainer.model_parts for m in part.modules() if isinstance(m, MoEFeedForward)]
    meshes = [list(w.device_mesh.mesh_dim_names) if isinstance(w, DTensor) else [] for w in w1]
    log = {"loss": [], "grad_norm": [], "params": sorted(loaded), "expert_meshes": meshes}
    original = trainer.metrics_processor.log

    def record(step, loss, max_loss, grad_norm, *args, **kwargs):
        log["loss"].append(loss)
        log["grad_norm"].append(grad_norm)
        return original(step, loss, max_loss, grad_norm, *args, **kwargs)

    trainer.metrics_processor.log = record
    trainer.train()
    with open(os.path.join(folder, f"{layout}.{rank}.json"), "w") as f:
        json.dump(log, f)


def run_layout(layout: str, folder: str, moe: MoEConfig) -> list[dict]:
    world = LAYOUTS[layout][0]
    launch.spawn(_train, world, layout, folder, moe)
    logs = []
    for r in range(world):
        with open(os.path.join(folder, f"{layout}.{r}.json")) as f:
            logs.append(json.load(f))
    return logs


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("titan"))
    return run_layout("one", folder, _moe())[0], folder


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2", "tp2_sp", "pp2", "ep2"])
def test_layout_matches_one_process(single, layout):
    ref, folder = single
    logs = run_layout(layout, folder, _moe())
    last = logs[-1]  # under PP only the last stage holds the loss; the others agree elsewhere
    assert len(last["loss"]) == STEPS
    torch.testing.assert_close(last["loss"], ref["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last["grad_norm"], ref["grad_norm"], rtol=1e-4, atol=1e-5)
    on_ep = {"ep" in names for log in logs for names in log["expert_meshes"]}
    assert on_ep == {layout == "ep2"}, logs[0]["expert_meshes"]  # only EP puts the experts on the ep mesh
    params = set().union(*(set(log["params"]) for log in logs))
    assert params == set(ref["params"]), "the layout's shards must hold every weight of the model"


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_router_losses_reach_the_gradient(scale):
    """The aux and z losses join the backward through the layer's output, times its scale."""
    from moe import MoE, aux_loss
    from moe.adapters.torchtitan import MoEFeedForward

    cfg = _moe(aux_loss_coef=0.5, z_loss_coef=0.1)
    torch.manual_seed(0)
    ff = MoEFeedForward.Config(moe=cfg).build()
    ff.init_states()
    ff.aux_loss_scale = scale
    ref = MoE(cfg)
    ref.load_state_dict(ff.moe.state_dict())
    x = torch.randn(3, 7, cfg.dim)
    ff(x).square().sum().backward()
    y = ref(x)
    (y.square().sum() + scale * aux_loss(ref)).backward()
    for (name, p), q in zip(ff.moe.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert ff.moe.router.weight.grad.abs().sum() > 0


def test_moe_model_spec_checks_the_width():
    from torchtitan.models.llama3 import model_registry

    from moe.adapters.torchtitan import moe_model_spec

    with pytest.raises(ValueError, match="moe.dim must equal the model dim 256"):
        moe_model_spec(model_registry("debugmodel"), _moe())
    spec = moe_model_spec(model_registry("debugmodel"), _moe(dim=256), every=2, first=1)
    assert spec.model.moe_layers() == [1, 3, 5]
    from moe.adapters.torchtitan import llama3_moe_debugmodel

    assert llama3_moe_debugmodel().model_spec.model.moe_layers() == [1, 3, 5]  # the --config entry point
