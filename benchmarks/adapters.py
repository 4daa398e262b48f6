"""Step time of a torchtitan feed-forward slot on CPU: our MoE (through `MoEFeedForward`)
against torchtitan's own MoE, same shape and routing (softmax top-k), forward + backward,
median of several repeats in one run. Needs the torchtitan extra.

    python -m benchmarks.adapters [--tokens 2048 --dim 256 --hidden 512 --experts 8 --top-k 2]
    python -m benchmarks.adapters --dtype bfloat16   # both layers' weights and input in bf16

torchtitan 0.3's experts cast their input and weights to bf16 before their grouped GEMM
whatever the layer's dtype, so in float32 its GEMMs are bf16 and ours fp32: ``--dtype
bfloat16`` is the like-for-like comparison. Prints each median with its min-max.

``--megatron``: the same for Megatron-core's MLP slot, our MoE (`moe.adapters.megatron`)
against Megatron's own ``MoELayer`` (needs the megatron extra). Megatron's MoE assumes CUDA in
a few places; the test-only CPU shims of tests/adapters/megatron_cpu.py are imported for it
(run from the repository root).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from torch import nn

from benchmarks.common import timed_turns, train_step


def _titan_moe(dim: int, hidden: int, experts: int, top_k: int):
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    init = {"weight": partial(nn.init.normal_, std=0.02)}
    cfg = make_moe_config(
        num_experts=experts,
        router=make_router_config(
            dim=dim, num_experts=experts, gate_param_init=init, top_k=top_k, score_func="softmax", route_norm=True
        ),
        routed_experts=make_routed_experts_config(
            dim=dim,
            hidden_dim=hidden,
            num_experts=experts,
            top_k=top_k,
            param_init={n: init["weight"] for n in ("w1_EFD", "w2_EDF", "w3_EFD")},
            comm_backend="standard",
        ),
        load_balance_coeff=None,
    )
    module = cfg.build()
    module.init_states()
    return module


def _ours(dim: int, hidden: int, experts: int, top_k: int):
    from moe import MoEConfig
    from moe.adapters.torchtitan import MoEFeedForward

    moe = MoEConfig(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k, router_options={"renormalize": True})
    module = MoEFeedForward.Config(moe=moe).build()
    module.init_states()
    return module


def _time(modules: list[nn.Module], x: torch.Tensor, repeats: int) -> list[list[float]]:
    """Each module's step times, the modules taking turns (a busy machine slows both)."""
    fns = {i: (lambda m=m: train_step(m, m, x)) for i, m in enumerate(modules)}
    return list(timed_turns(fns, repeats).values())


def _row(shape: str, names: tuple[str, str], times: list[list[float]], dtype: torch.dtype) -> str:
    cells = [
        f"{name} {statistics.median(ts) * 1e3:.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"
        for name, ts in zip(names, times, strict=True)
    ]
    ratio = statistics.median(times[0]) / statistics.median(times[1])
    return f"| {shape} {str(dtype).removeprefix('torch.')} | {cells[0]} | {cells[1]} | ours / theirs {ratio:.2f} |"


def _megatron_slots(dim: int, hidden: int, experts: int, top_k: int):
    """Megatron's MoELayer (softmax top-k, SequentialMLP experts: its GroupedMLP needs the
    grouped_gemm package, its alltoall dispatcher a CUDA stream) and our MoE in the same slot."""
    import tempfile

    import torch.distributed as dist

    from tests.adapters import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import build_module

    from moe.adapters.megatron import moe_module_spec

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    cfg = megatron_cpu.moe_layer_config(dim=dim, hidden=hidden, experts=experts, top_k=top_k)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    theirs = MoELayer(cfg, spec.submodules.mlp.submodules)
    ours = build_module(moe_module_spec(), config=cfg)
    return [_FirstOutput(ours), _FirstOutput(theirs)]


class _FirstOutput(nn.Module):
    """A Megatron MLP slot returns (output, bias): keep the output."""

    def __init__(self, slot: nn.Module) -> None:
        super().__init__()
        self.slot = slot

    def forward(self, x):
        return self.slot(x)[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--megatron", action="store_true", help="Megatron-core's MLP slot instead of torchtitan's")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and input")
    a = p.parse_args(argv)
    if a.tokens % 4 or a.tokens <= 0:
        p.error(f"--tokens must be a positive multiple of 4 (the batch is 4 sequences), got {a.tokens}")
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    shape = (a.dim, a.hidden, a.experts, a.top_k)
    label = f"T={a.tokens} D={a.dim} F={a.hidden} E={a.experts} K={a.top_k}"
    if a.megatron:
        x = torch.randn(a.tokens // 4, 4, a.dim, dtype=dtype)  # Megatron's [s, b, h]
        modules, names = _megatron_slots(*shape), ("ours", "Megatron MoELayer")
    else:
        x = torch.randn(4, a.tokens // 4, a.dim, dtype=dtype)
        modules, names = [_ours(*shape), _titan_moe(*shape)], ("ours", "torchtitan MoE")
    print(_row(label, names, _time([m.to(dtype) for m in modules], x, a.repeats), dtype))


if __name__ == "__main__":
    main()
