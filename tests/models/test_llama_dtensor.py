"""The model's promises to tensor parallelism, on 2 gloo processes: attention and MLPs sharded
colwise/rowwise run unchanged on their local heads, and `init_weights` initialises DTensor
shards after a meta build. (The layouts themselves are `moe.parallel`'s and tested there.)"""

import copy

import pytest
import torch

from moe.models import Llama, LlamaConfig
from moe.models.llama.hf import to_hf_state_dict

from ..parallel.launch import init, spawn

pytestmark = pytest.mark.distributed


def _shard(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers.values():
        plan = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
        plan["attention.wo"] = RowwiseParallel()
        if not block.is_moe:  # an MoE layer stays whole on every rank here
            plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()})
            plan["feed_forward.w2"] = RowwiseParallel()
        parallelize_module(block, mesh, plan)
    return model


def _worker(rank, world, store):
    init(rank, world, store)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    config = LlamaConfig.from_name("tiny")
    torch.manual_seed(0)
    whole = Llama(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 10))
    sharded = _shard(copy.deepcopy(whole), mesh).eval()
    wq = sharded.layers["0"].attention.wq.weight
    assert isinstance(wq, DTensor) and wq.to_local().shape[0] == config.dim // world  # 2 of 4 heads here
    with torch.no_grad():
        torch.testing.assert_close(sharded(tokens), whole(tokens), rtol=1e-5, atol=1e-5)
    # writing a checkpoint gathers the shards (every rank calls)
    gathered = to_hf_state_dict(sharded, merge_experts="mean")
    for key, w in to_hf_state_dict(whole, merge_experts="mean").items():
        torch.testing.assert_close(gathered[key], w, rtol=0, atol=0, msg=key)

    with torch.device("meta"):
        lazy = Llama(config)
    _shard(lazy, mesh)
    lazy.to_empty(device="cpu")
    torch.manual_seed(1)
    lazy.init_weights()
    w1 = lazy.layers["0"].feed_forward.w1.weight
    assert isinstance(w1, DTensor)
    full = w1.full_tensor()
    assert abs(full.std().item() - config.init_std) < 0.1 * config.init_std
    assert bool((lazy.layers["2"].attention_norm.weight == 1).all())
    with torch.no_grad():
        out = lazy(tokens)
    assert torch.isfinite(out).all()


def test_tensor_parallel_shards_run_unchanged_and_initialise():
    spawn(_worker, 2)
