"""The planner's parameter shards equal the real model's, rank by rank: the model is built on
the meta device and laid out by the real `parallelize_llama` / `pipeline_llama` on PyTorch's
fake process group (one process stands for any rank of a world of any size; nothing is
communicated), and the local numel of every parameter (``DTensor.to_local()``) is compared
with `moe.plan.shards.rank_params` and the bytes with `moe.plan.memory`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe.models.llama import Llama, LlamaConfig
from moe.models.llama.model import TransformerBlock
from moe.parallel import parallelize_llama, pipeline_llama
from moe.parallel.layout import LlamaMesh
from moe.parallel.pipeline import stage_layers
from moe.plan.layout import Layout
from moe.plan.memory import TrainShape, memory, param_bytes
from moe.plan.shards import rank_params


def _mesh(lay: Layout, rank: int) -> LlamaMesh:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world)
    dims = ("pp", "dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", tuple(getattr(lay, d) for d in dims), mesh_dim_names=dims)
    return LlamaMesh.build(mesh, ep=lay.ep)


def _local(models) -> dict[str, int]:
    out = {}
    for part in models:
        for name, p in part.named_parameters():
            out[name] = (p.to_local() if isinstance(p, DTensor) else p).numel()
    return out


def _stage_model(cfg: LlamaConfig, lay: Layout, stage: int) -> Llama:
    """Stage ``stage`` as `pipeline_llama` cuts it (its `stage_layers`), only its layers built."""
    runs = stage_layers([str(i) for i in range(cfg.n_layers)], lay.num_stages)
    with torch.device("meta"):
        part = Llama(LlamaConfig.from_name("tiny", n_layers=1))  # a shell: its parts are replaced
        part.config = cfg
        part.layers = nn.ModuleDict({i: TransformerBlock(int(i), cfg) for i in runs[stage]})
        part.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if stage == 0 else None
        last = stage == lay.num_stages - 1
        part.norm = type(part.norm)(cfg.dim, cfg.norm_eps) if last else None
        part.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if last else None
    return part


def _check_rank(cfg: LlamaConfig, lay: Layout, rank: int, **options) -> None:
    lm = _mesh(lay, rank)
    try:
        p = lay.coords(rank)["pp"]
        parts = []
        for stage in range(p, lay.num_stages, lay.pp):
            parts.append(parallelize_llama(_stage_model(cfg, lay, stage), lm, ep=lay.ep, etp=lay.etp, **options))
        got = _local(parts)
    finally:
        dist.destroy_process_group()
    want = rank_params(cfg, lay, rank)
    assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
    assert param_bytes(cfg, lay, rank) == 4 * sum(got.values())  # fp32 shards (the meta model's dtype)
    shape = TrainShape(seq_len=2 * lay.tp, global_batch_tokens=2 * lay.tp * lay.dp * lay.pp)
    assert memory(cfg, lay, shape, rank)["params"] == 4 * sum(got.values())  # the per-kind fast path too


def _ranks(lay: Layout) -> list[int]:
    """Ranks of the first, a middle and the last pipeline stage, at varied other coordinates."""
    last = lay.world - 1
    mid = lay.rank(pp=lay.pp // 2, dp_shard_mod_ep=lay.dp_shard_mod_ep // 2, ep=lay.ep - 1, tp=lay.tp // 2)
    return sorted({0, mid, last})


SMALL = [
    # name, layout, overrides: awkward sizes so shards are uneven somewhere
    ("tiny", Layout(dp_shard=4), {}),
    ("tiny", Layout(dp_shard=8), {}),  # 4 experts over 8 ranks, in the block's unit: FSDP shards their D
    ("tiny", Layout(tp=2, dp_shard=3), {"n_layers": 5}),
    ("tiny", Layout(tp=2, pp=2, ep=2, dp_shard=4, dp_replicate=2), {}),
    ("tiny", Layout(tp=2, ep=2, etp=True, dp_shard=6), {}),
    ("tiny", Layout(ep=4, dp_shard=4, dp_replicate=3), {"vocab_size": 131}),
    ("tiny", Layout(ep=2, dp_shard=8), {}),  # 2 experts per ep rank over 4 edp ranks: FSDP shards D
    ("small", Layout(tp=4, pp=3, ep=2, etp=True, dp_shard=2, dp_replicate=2), {"n_layers": 7}),
    ("deepseek-v3-like", Layout(tp=2, pp=2, ep=4, dp_shard=8), {"n_layers": 6}),
]


@pytest.mark.parametrize("name,lay,over", SMALL, ids=[f"{n}-{lay.short()}" for n, lay, _ in SMALL])
def test_small_layouts_exact(name, lay, over):
    cfg = LlamaConfig.from_name(name, **over)
    for rank in _ranks(lay):
        _check_rank(cfg, lay, rank)


def test_pipeline_llama_interleaved_exact():
    """The real `pipeline_llama` (it cuts the whole model and deep-copies the stages)."""
    cfg = LlamaConfig.from_name("tiny", n_layers=7)
    lay = Layout(tp=2, pp=2, vpp=2, schedule="interleaved_1f1b", ep=2, dp_shard=2)
    for rank in _ranks(lay):
        lm = _mesh(lay, rank)
        try:
            with torch.device("meta"):
                model = Llama(cfg)
            pipe = pipeline_llama(model, lm, schedule=lay.schedule, microbatches=4, stages_per_rank=2, ep=lay.ep)
            got = _local(pipe.models)
        finally:
            dist.destroy_process_group()
        assert got == rank_params(cfg, lay, rank)


BIG = [
    Layout(tp=8, pp=8, ep=8, dp_shard=64),  # 4096 ranks: 3 experts per ep rank, their D over 8 edp ranks
    Layout(tp=8, pp=4, ep=8, etp=True, dp_shard=16, dp_replicate=2),  # 1024 ranks, HSDP, etp
    Layout(tp=4, pp=8, vpp=2, schedule="interleaved_1f1b", ep=8, dp_shard=32),  # 1024 ranks, 16 stages
]


@pytest.mark.parametrize("lay", BIG, ids=[lay.short() for lay in BIG])
def test_llama2_moe_1_2t_exact(lay):
    cfg = LlamaConfig.from_name("llama2-moe-1.2t")
    assert cfg.num_params() >= 1.2e12 and lay.world >= 1024
    for rank in _ranks(lay):
        _check_rank(cfg, lay, rank)
