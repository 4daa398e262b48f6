"""torchtitan's own trainer with our MoE in its Llama: one process against TP2 (SP), FSDP2 dp=2,
PP2 and EP2 on CPU with gloo, same losses and gradient norms over three steps; activation
checkpointing on and off; global BASE under dp and ep.

The shims that make torchtitan run on CPU are in tests/adapters/titan_cpu.py, each commented
with what it replaces. Every layout starts from the same weights (a full state dict built once
from the same seed, loaded into each layout's shards) and sees the same global batches
(`titan_cpu.FixedBatches`)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

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
    # HSDP's replicate dimension (torchtitan's dp_replicate mesh; shard degree 1 on two ranks)
    "hsdp_replicate2": (2, {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}),
}


def _moe(**overrides) -> MoEConfig:
    return MoEConfig(**{"dim": 48, "hidden_dim": 40, "num_experts": 4, "top_k": 2, **overrides})


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run inside a launch: the MoE, activation checkpointing, global BASE, and the
    one-process job it must equal."""

    moe: MoEConfig
    ac: str | None = None  # torchtitan's --activation_checkpoint.mode: "full", "selective" or None
    global_base: bool = False
    reference: str = "topk"


# The z loss is a mean over tokens, so the ranks' scaled losses add up to one process's; the
# load-balancing loss is a product of means over each forward's tokens, which a split batch
# changes, so it is compared only in one process, with activation checkpointing on and off.
JOBS = {
    "topk": Job(_moe(z_loss_coef=0.01)),
    "topk_aux": Job(_moe(aux_loss_coef=0.05, z_loss_coef=0.01), reference="topk_aux"),
    "topk_aux_selective_ac": Job(_moe(aux_loss_coef=0.05, z_loss_coef=0.01), ac="selective", reference="topk_aux"),
    "topk_full_ac": Job(_moe(z_loss_coef=0.01), ac="full"),
    "topk_selective_ac": Job(_moe(z_loss_coef=0.01), ac="selective"),
    "base": Job(_moe(router="base"), reference="base"),
    "base_global": Job(_moe(router="base"), global_base=True, reference="base"),
}
# What each launch trains, one job after the other in the same processes (a launch costs far
# more than a three-step run). Selective checkpointing (torchtitan's default) runs in one
# process and under TP, full checkpointing under EP (the re-runs repeat TP's redistributions and
# EP's collectives), each against one process without checkpointing.
RUNS = {
    "one": ["topk", "topk_aux", "topk_aux_selective_ac", "base"],
    "fsdp2": ["topk", "base_global"],
    "tp2_sp": ["topk_selective_ac"],
    "pp2": ["topk"],
    "ep2": ["topk_full_ac", "base_global"],
    "hsdp_replicate2": ["topk"],
}


def trainer_config(folder: str, parallelism: dict, job: Job):
    """torchtitan's llama3 debug config, shrunk to a 4-block model with our MoE in blocks 1 and 3."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from moe.adapters.torchtitan import moe_model_spec

    tok, data = titan_cpu.write_assets(folder)
    cfg = llama3_debugmodel()
    spec = dataclasses.replace(cfg.model_spec, model=titan_cpu.tiny_llama3())
    cfg.model_spec = moe_model_spec(spec, job.moe, every=2, first=1, global_base=job.global_base)
    cfg.hf_assets_path = tok
    cfg.dataloader = titan_cpu.FixedBatches.Config(dataset_path=data)
    cfg.training.seq_len = 32
    dp = parallelism.get("data_parallel_shard_degree", 1) * parallelism.get("data_parallel_replicate_degree", 1)
    cfg.training.local_batch_size = 4 // dp  # the same global batch of 4 in every layout
    cfg.training.steps = STEPS
    cfg.training.disable_cuda_graphs = True
    cfg.training.mixed_precision_param = "float32"  # bf16 rounding would depend on the batch split
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.activation_checkpoint = {"full": FullAC.Config, "selective": SelectiveAC.Config, None: lambda: None}[job.ac]()
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
    buffers = [(n, b) for n, b in part.named_buffers() if n.replace("_checkpoint_wrapped_module.", "") in full]
    for wrapped, t in [*part.named_parameters(), *buffers]:
        name = wrapped.replace("_checkpoint_wrapped_module.", "")  # activation checkpointing's wrapper
        if name not in full:
            raise KeyError(f"{name} is not in the reference weights")
        src = full[name]
        if isinstance(t, DTensor):
            t.to_local().copy_(distribute_tensor(src, t.device_mesh, t.placements).to_local())
        else:
            t.copy_(src)
        names.add(name)
    return names


def _train(rank: int, world: int, store: str, layout: str, folder: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    titan_cpu.install()
    launch.init(rank, world, store)
    for name in RUNS[layout]:
        start = time.perf_counter()
        log = _train_job(os.path.join(folder, f"r{rank}"), LAYOUTS[layout][1], JOBS[name])
        log["seconds"] = time.perf_counter() - start  # for the record only: what a job adds to CI
        with open(os.path.join(folder, f"{layout}.{name}.{rank}.json"), "w") as f:
            json.dump(log, f)


def _train_job(folder: str, parallelism: dict, job: Job) -> dict:
    from torch.distributed.tensor import DTensor

    from moe.adapters.torchtitan import MoEFeedForward

    cfg = trainer_config(folder, parallelism, job)
    full = reference_state(cfg)
    trainer = cfg.build()
    titan_cpu.adapt_schedule(trainer)
    loaded = set()
    for part in trainer.model_parts:
        loaded |= load_full(part, full)
    layers = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, MoEFeedForward)]
    meshes = [
        list(m.moe.experts.w1.device_mesh.mesh_dim_names) if isinstance(m.moe.experts.w1, DTensor) else []
        for m in layers
    ]
    balanced = [type(m.moe.router.assign).__name__ for m in layers if hasattr(m.moe.router, "assign")]
    log = {"loss": [], "grad_norm": [], "params": sorted(loaded), "expert_meshes": meshes, "assign": balanced}
    original = trainer.metrics_processor.log

    def record(step, loss, max_loss, grad_norm, *args, **kwargs):
        log["loss"].append(loss)
        log["grad_norm"].append(grad_norm)
        return original(step, loss, max_loss, grad_norm, *args, **kwargs)

    trainer.metrics_processor.log = record
    trainer.train()
    trainer.close()
    if job.moe.router == "base":  # the last step's assignment of this rank's tokens, per MoE layer
        log["routing"] = [m.moe.last_routing.expert_idx.tolist() for m in layers]
    if job.global_base and len(trainer.model_parts) == 1:
        log["failure"] = _fail_on_one_rank(trainer.model_parts[0], layers[0])
    return log


def _fail_on_one_rank(model: torch.nn.Module, layer: torch.nn.Module) -> str:
    """A training forward in which the first MoE layer's input is NaN on the last rank only:
    what this rank raised (every rank must raise, none may wait in the global solve's
    exchange)."""
    import torch.distributed as dist

    if dist.get_rank() == dist.get_world_size() - 1:
        layer.register_forward_pre_hook(lambda module, args: (torch.full_like(args[0], float("nan")),))
    try:
        with torch.no_grad():
            model(torch.zeros(2, 32, dtype=torch.long))
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


def run_layout(layout: str, folder: str) -> dict[str, list[dict]]:
    """Train the layout's jobs; their logs by job name, one per rank."""
    world = LAYOUTS[layout][0]
    launch.spawn(_train, world, layout, folder)
    logs = {}
    for name in RUNS[layout]:
        logs[name] = []
        for r in range(world):
            with open(os.path.join(folder, f"{layout}.{name}.{r}.json")) as f:
                logs[name].append(json.load(f))
    return logs


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("titan"))
    return {name: logs[0] for name, logs in run_layout("one", folder).items()}, folder


def _same_training(log: dict, ref: dict) -> None:
    assert len(log["loss"]) == STEPS
    torch.testing.assert_close(log["loss"], ref["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log["grad_norm"], ref["grad_norm"], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2", "tp2_sp", "pp2", "ep2", "hsdp_replicate2"])
def test_layout_matches_one_process(single, layout):
    refs, folder = single
    for name, logs in run_layout(layout, folder).items():
        job = JOBS[name]
        _same_training(logs[-1], refs[job.reference])  # under PP only the last stage holds the loss
        on_ep = {"ep" in names for log in logs for names in log["expert_meshes"]}
        assert on_ep == {layout == "ep2"}, logs[0]["expert_meshes"]  # only EP puts the experts on the ep mesh
        if job.global_base:  # the assignment is solved over every data-parallel rank's tokens
            assert {a for log in logs for a in log["assign"]} == {"GroupBalance"}
            # exactly one process's: the ranks' tokens, in rank order, are its batch (per-rank
            # BASE moves the losses by only ~1e-6 here, inside the tolerance); each token's
            # experts as a set: their order follows the prices they were picked under, and a warm
            # group call may keep its ranks' local start where one process has none
            for i, ref_idx in enumerate(refs["base"]["routing"]):
                got = sum((log["routing"][i] for log in logs), [])
                assert [sorted(e) for e in got] == [sorted(e) for e in ref_idx], f"MoE layer {i}"
            # NaN input on the last rank: it raises, and the others too instead of waiting for it
            assert "x must be finite" in logs[-1]["failure"], logs[-1]["failure"]
            assert all("PeerFailedError" in log["failure"] for log in logs[:-1]), logs[0]["failure"]
        params = set().union(*(set(log["params"]) for log in logs))
        assert params == set(refs[job.reference]["params"]), "the layout's shards must hold every weight of the model"


def test_selective_activation_checkpointing_trains_alike(single):
    """torchtitan's --activation_checkpoint.mode selective (its default) against none, with the
    load-balancing and z losses on: the same losses and gradient norms. (Selective under TP
    and full under EP run in those layouts.)"""
    refs, _ = single
    log, ref = refs["topk_aux_selective_ac"], refs["topk_aux"]
    _same_training(log, ref)
    assert ref["grad_norm"] != refs["topk"]["grad_norm"]  # the load-balancing loss is in the gradients


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


def test_global_base_needs_base_routers():
    from torchtitan.models.llama3 import model_registry

    from moe.adapters.torchtitan import moe_model_spec

    with pytest.raises(ValueError, match="global_base=True needs moe.router='base', got 'topk'"):
        moe_model_spec(model_registry("debugmodel"), _moe(dim=256), global_base=True)


def test_expert_parallelism_with_tensor_parallelism_is_refused_before_any_change():
    """Refused up front, naming both degrees: our layer routes every token on each tp rank,
    while torchtitan's ep mesh takes tp ranks."""
    import types

    from moe.adapters.torchtitan import Llama3MoEModel, parallelize_llama_moe

    tiny = titan_cpu.tiny_llama3(n_layers=2)
    model = Llama3MoEModel.Config(**{f.name: getattr(tiny, f.name) for f in dataclasses.fields(tiny)}, moe=_moe())
    dims = types.SimpleNamespace(tp_enabled=True, ep_enabled=True, tp=2, ep=2)  # read before anything else
    with pytest.raises(NotImplementedError, match="tensor_parallel_degree=2 with expert_parallel_degree=2"):
        parallelize_llama_moe(model.build(), parallel_dims=dims, training=None, parallelism=None)
