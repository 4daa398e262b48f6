"""Test-only shims that let torchtitan's trainer run on CPU with gloo (never imported by `moe`).

torchtitan 0.3 assumes an accelerator: with none visible its ``device_type`` falls back to
"cuda" and its memory monitor reads ``torch.cuda`` statistics. Each shim below says what it
replaces; nothing else of torchtitan is changed.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass

import torch
from torchtitan.components.dataloader import BaseDataLoader

VOCAB = 258  # the byte-level tokenizer written by `write_assets`: 256 bytes, <s>, </s>


class _CpuDevice(types.SimpleNamespace):
    """Replaces ``torch.cuda`` as torchtitan's ``device_module``: the calls its trainer and
    memory monitor make, answered for the host (no memory statistics: zeros)."""

    def __init__(self) -> None:
        super().__init__(
            set_device=lambda device: None,
            current_device=lambda: 0,
            device_count=lambda: 1,
            get_device_name=lambda device=None: "cpu",
            get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 40, name="cpu"),
            reset_peak_memory_stats=lambda device=None: None,
            empty_cache=lambda: None,
            memory_stats=lambda device=None: {},
            synchronize=lambda device=None: None,
            is_available=lambda: True,
        )


def install() -> None:
    """Point torchtitan at the CPU. Replaces, in every module that copied them at import,
    ``torchtitan.tools.utils.device_type`` ("cuda" when no accelerator is visible) with "cpu"
    and ``device_module`` (``torch.cuda``) with `_CpuDevice`."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils
    from torch.distributed.fsdp import FSDPModule

    cpu = _CpuDevice()
    for mod in (tools_utils, metrics, dist_utils, parallel_dims):
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = cpu
    metrics.DeviceMemoryMonitor.__init__.__defaults__ = ("cpu:0",)
    # Replaces set_pg_timeouts, which shortens the groups' timeouts after the first step
    # through torch.distributed.set_timeout, a function torch 2.13 does not have: the
    # groups keep the timeout they were made with.
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    # Replaces disable_fsdp_gradient_division's reduce op: with a divide factor of 1 FSDP2
    # reduce-scatters with ReduceOp.PREMUL_SUM(1.0), which gloo lacks; forcing sum reductions
    # gives the same sums.
    original = fsdp.disable_fsdp_gradient_division

    def sum_not_premul(model):
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_not_premul
    # Replaces the 2 s sleep at the end of Trainer.train on rank 0 ("for other ranks to
    # complete"): the tests' launcher joins every process itself, and a launch trains several
    # runs one after the other.
    import torchtitan.trainer as trainer

    trainer.time = types.SimpleNamespace(**{**vars(trainer.time), "sleep": lambda seconds: None})


def adapt_schedule(trainer) -> None:
    """Replaces the call torchtitan 0.3's trainer makes to its pipeline schedule: it passes
    ready-made microbatches (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``), which torch 2.13's
    schedules do not take; they take the whole batch and cut it into the same microbatches
    (equal splits along the batch dim), so the microbatches are concatenated back."""
    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None:
        return
    step = schedule.step

    def cat(parts):
        return torch.cat(parts, dim=0) if parts else None

    def whole_batch_step(*, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, loss_kwargs=None, **rest):
        args = tuple(cat(list(a)) for a in zip(*arg_mbs, strict=True)) if arg_mbs else ()
        kwargs = {k: cat([kw[k] for kw in kwarg_mbs]) for k in kwarg_mbs[0]} if kwarg_mbs else {}
        return step(*args, target=cat(target_mbs), losses=losses, loss_kwargs=loss_kwargs, **rest, **kwargs)

    schedule.step = whole_batch_step


_TEXT = (
    "the quick brown fox jumps over the lazy dog while experts route tokens to balanced slots; "
    "pipelines cut the model into stages and tensors are split across ranks so that the same "
    "loss comes out of every layout of the same model on the same data. "
)


def write_assets(folder: str, docs: int = 64) -> tuple[str, str]:
    """A local byte-level tokenizer (no download) and a small json dataset under ``folder``;
    returns (tokenizer folder, dataset folder). Replaces the tokenizer and the ``c4_test``
    files that torchtitan's repository ships but its wheel does not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok_dir, data_dir = os.path.join(folder, "tokenizer"), os.path.join(folder, "data")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": VOCAB - 2, "</s>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), pre_tokenizers.Split("", "isolated")]
    )
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}, f)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": f"{i} " + _TEXT[i % 17 :] + _TEXT[: i % 29]}) + "\n")
    return tok_dir, data_dir


def tiny_llama3(dim: int = 48, n_layers: int = 4, n_heads: int = 4):
    """A small torchtitan Llama3 config built from its public pieces. Attention is torchtitan's
    ``ScaledDotProductAttention`` (causal over the whole sample): it replaces FlexAttention,
    whose backward torch 2.13 has no CPU kernel for."""
    from functools import partial

    from torch import nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm = {"weight": nn.init.ones_}
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                wqkv_param_init=init,
                wo_param_init=init,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=256, theta=10000.0),
            ),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=2 * dim, w1_param_init=init, w2w3_param_init=init),
        )
        for _ in range(n_layers)
    ]
    return Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init={"weight": nn.init.normal_}
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=init),
        layers=layers,
    )


class FixedBatches(BaseDataLoader):
    """Replaces torchtitan's HuggingFaceTextDataLoader, which splits the documents between
    data-parallel ranks (rank r packs its own shard): here every layout sees the same global
    batch per step. The documents are tokenized with the trainer's tokenizer, packed into rows
    of seq_len + 1 tokens, and the i-th call on data-parallel rank r of W returns rows
    [(i*W + r)*n, (i*W + r + 1)*n) for a batch of n rows (pipeline microbatches are just more
    calls), so one process, dp=2 and PP microbatches all cut the same rows."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config: Config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **_):
        with open(os.path.join(config.dataset_path, "train.json")) as f:
            texts = [json.loads(line)["text"] for line in f]
        ids = [t for text in texts for t in tokenizer.encode(text, add_bos=True, add_eos=True)]
        n_rows = len(ids) // (seq_len + 1)
        self.rows = torch.tensor(ids[: n_rows * (seq_len + 1)]).view(n_rows, seq_len + 1)
        self.world, self.rank, self.n = dp_world_size, dp_rank, local_batch_size
        self.calls = 0

    def __iter__(self):
        while True:
            start = (self.calls * self.world + self.rank) * self.n
            if start + self.n > self.rows.shape[0]:
                raise ValueError(f"FixedBatches: {self.rows.shape[0]} rows run out at call {self.calls}")
            self.calls += 1
            rows = self.rows[start : start + self.n]
            yield {"input": rows[:, :-1].clone()}, rows[:, 1:].clone()

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state_dict):
        self.calls = state_dict["calls"]
