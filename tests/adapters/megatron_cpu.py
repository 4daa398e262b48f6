"""Test-only shims that let Megatron-core 0.16 build and run a GPT on CPU with gloo (never
imported by `moe`). Megatron assumes CUDA in a few places on the path a GPT takes; each shim
below says what it replaces and why. Nothing else of Megatron is changed.
"""

from __future__ import annotations

import contextlib

import torch


class _NoRngTracker:
    """Replaces Megatron's ``CudaRNGStatesTracker``: it forks CUDA generator states around
    dropout in attention and TP weight init. The tests run with dropout 0 and initialise on
    the CPU (``use_cpu_initialization``), so there is nothing random for a fork to guard."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()

    def add(self, name, seed) -> None:
        pass

    def reset(self) -> None:
        pass

    def get_states(self) -> dict:
        return {}

    def set_states(self, states) -> None:
        pass


class _TorchOnCpu:
    """Replaces the ``torch`` module as seen by Megatron's pipeline schedules, which make their
    token counter with ``torch.zeros([], device="cuda")``: the same module, except that a
    tensor asked for on "cuda" is made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)


class LayerNorm(torch.nn.LayerNorm):
    """Replaces the norm of Megatron's local spec where Apex is missing: its fallback,
    ``WrappedTorchNorm``, refuses sequence parallelism because it does not mark its weights
    ``sequence_parallel``, the mark by which ``finalize_model_grads`` sums their gradients over
    the tp ranks (each saw a part of the sequence); Apex's ``FusedLayerNorm``, what the spec
    uses where Apex is installed (CUDA only), marks them. This is torch's LayerNorm with the mark."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> None:
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def install() -> None:
    """Point Megatron at the CPU (idempotent)."""
    from megatron.core.tensor_parallel import random as meg_random

    if isinstance(meg_random._CUDA_RNG_STATE_TRACKER, _NoRngTracker):
        return

    # Replaces torch.cuda.current_device, which Megatron calls for the device of buffers it
    # makes during the forward (rotary frequencies, pipeline p2p buffers): "cpu" is a device
    # argument everywhere the int index was.
    torch.cuda.current_device = lambda: "cpu"
    meg_random._CUDA_RNG_STATE_TRACKER = _NoRngTracker()
    meg_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()
    from megatron.core.transformer.moe import moe_utils

    # Megatron's own MoE router (used by the benchmark, not by our layer) reads
    # ``te_general_gemm``, a name moe_utils defines only where Transformer Engine (CUDA only)
    # imports: None is what it tests for to take its torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Replaces torch.cuda.synchronize, which Megatron's pipeline p2p calls after its sends and
    # receives; gloo's waits have already completed them.
    torch.cuda.synchronize = lambda device=None: None
    # Replaces Megatron's CUDA generator save/restore around its activation recompute
    # (``CheckpointFunction`` keeps the CPU, CUDA and tracker states of the first forward for
    # the re-run): there is no CUDA generator here, and the CPU state is still kept.
    meg_random._get_cuda_rng_state = lambda *args, **kwargs: None
    meg_random._set_cuda_rng_state = lambda *args, **kwargs: None


def moe_layer_config(*, dim: int, hidden: int, experts: int, top_k: int, **overrides):
    """The ``TransformerConfig`` of one Megatron MoE layer that builds and runs on CPU: SwiGLU
    SequentialMLP experts without bias, CPU initialisation, the all-gather dispatcher (the
    all-to-all one makes a CUDA stream when built), Megatron's CUDA-only fusions off."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=dim,
        num_attention_heads=2,
        ffn_hidden_size=hidden,
        num_moe_experts=experts,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=hidden,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**{**fields, **overrides})
