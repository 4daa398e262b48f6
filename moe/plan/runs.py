"""Published training runs the time model is checked against (docs/scale.md, "Calibration").

Each row is the published layout in our terms: Megatron's DP ranks are our ``dp_shard`` (``ep``
folded onto them), Megatron's distributed optimizer and plain DDP gather or reduce once a step
(our ``reshard=0``), its fp16 or bf16 mixed precision our ``bf16``. Where a source leaves out a
field, the row says what was assumed. ``attention`` describes the model's attention where it
is not the Llama attention of its `LlamaConfig` (DeepSeek-V3's MLA: `moe.plan.attention`).
``split`` says whether the efficiencies were fitted on the row ("fit") or it only checks them
("held-out"); the split was fixed before any new row's error was computed (docs/scale.md says
why).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MoEConfig
from ..models.llama import LlamaConfig
from .attention import DEEPSEEK_V3_MLA, AttentionShape
from .layout import Layout

__all__ = ["A100_SPEC", "RUNS", "PublishedRun", "megatron_tflops_to_tokens"]

# A100 SXM 80 GB through --gpu-spec: 312 TFLOP/s bf16/fp16 dense (no fp8: the fp8 field is set to it),
# 2.039 TB/s HBM, NVLink 3 at 300 GB/s per direction, one 200 Gb/s HDR NIC per GPU (Selene)
A100_SPEC = "hbm_bytes=85899345920,bf16_flops=312e12,fp8_flops=312e12,hbm_bw=2.039e12,nvlink_bw=300e9,net_bw=25e9"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str | LlamaConfig  # our preset, or the published shape
    gpu: str
    layout: Layout
    seq_len: int
    global_batch_seqs: int
    tokens_per_s_per_gpu: float | None  # published (or derived from a published step time, see source)
    tflops_per_gpu: float | None  # published model TFLOP/s per GPU
    source: str
    split: str = "fit"  # "fit" or "held-out"
    gpu_spec: str | None = None  # --gpu-spec overrides of the preset
    attention: AttentionShape | None = None  # None: the Llama attention of `config()`

    def config(self) -> LlamaConfig:
        return LlamaConfig.from_name(self.model) if isinstance(self.model, str) else self.model


def megatron_tflops_to_tokens(tflops: float, layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Tokens/s/GPU behind a Megatron-LM (2021) TFLOP/s figure: that paper counts
    96 l h^2 (1 + s / 6h + V / 16 l h) FLOPs per token (activation recomputation included)."""
    per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return tflops * 1e12 / per_token


# Llama 3 405B (the Llama 3 paper, table of 4D-parallel configurations): 126 layers, dim 16384,
# 128 heads, 8 KV heads, SwiGLU 53248, vocabulary 128256
LLAMA3_405B = LlamaConfig(
    dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_dim=53248, vocab_size=128256, max_seq_len=8192,
)  # fmt: skip
# Nemotron-4 340B (its technical report): 96 layers, dim 18432, 96 heads, 8 KV heads, vocabulary
# 256000, a squared-ReLU MLP of width 73728 (two matrices); here SwiGLU of width 49152, the same
# parameters and FLOPs
NEMOTRON4_340B = LlamaConfig(
    dim=18432, n_layers=96, n_heads=96, n_kv_heads=8, ffn_hidden_dim=49152, vocab_size=256000, max_seq_len=4096,
)  # fmt: skip
# Megatron-LM's 1T GPT (Narayanan et al. 2021, Table 1): 128 layers, hidden 25600, 160 heads,
# vocabulary 51200, sequence 2048, a GELU MLP of 4h (here SwiGLU of 8h/3: the same FLOPs)
GPT_1T = LlamaConfig(
    dim=25600, n_layers=128, n_heads=160, ffn_hidden_dim=68266, vocab_size=51200, max_seq_len=2048,
)  # fmt: skip

# Llama 3 70B (its model card): 80 layers, dim 8192, 64 heads, 8 KV heads, SwiGLU 28672, vocabulary 128256
LLAMA3_70B = LlamaConfig(
    dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, vocab_size=128256, rope_theta=5e5,
    max_seq_len=8192,
)  # fmt: skip
# DeepSeek-V3 under NeMo AutoModel's benchmark gate (fake_balanced_gate): token t takes experts
# 8t .. 8t + 7 (mod 256), eight neighbours, which at 4 experts a rank lie in one node of the
# 8-node ep group: node-limited routing with one node kept (topk_groups 1 of the 8 node groups)
DSV3_ONE_NODE = LlamaConfig.from_name(
    "deepseek-v3-like",
    moe=MoEConfig.from_name(
        "deepseek-v3", router_options=dict(score_func="sigmoid", n_groups=8, topk_groups=1, bias_update_rate=0.001)
    ),
)

RUNS = [
    PublishedRun(
        "Megatron-core Mixtral 8x7B, 64 H100, bf16, TP1 EP8 PP4", "mixtral-8x7b", "h100",
        Layout(pp=4, ep=8, dp_shard=16, reshard=False), 4096, 256, None, 468.0,
        "Megatron-core MoE README (seq 4096 and global batch 256 assumed: NeMo's Mixtral recipe)",
    ),
    PublishedRun(
        "NeMo Llama 2 70B, H200, fp8", "llama2-70b", "h200",
        Layout(tp=4, pp=4, vpp=20, schedule="interleaved_1f1b", dp_shard=4, precision="fp8", reshard=False),
        4096, 128, 1880.0, 836.0,
        "NVIDIA NeMo H200 blog; layout TP4 PP4 VP20 on 64 GPUs, batch 128 assumed from NeMo's H100 recipe",
    ),
    PublishedRun(
        "DeepSeek-V3, 2048 H800, fp8, TP1 PP16 EP64", "deepseek-v3-like", "h800",
        Layout(pp=16, ep=64, dp_shard=128, precision="fp8", reshard=False, dispatch="hierarchical", chunks=2),
        4096, 15360, 1543.0, None,
        "DeepSeek-V3 report: 180K H800 hours per trillion tokens = 1543 tokens/s/GPU; batch 15360 x 4096; "
        "node-limited routing (8 groups = the 8 nodes of an ep group, 4 kept), two-level dispatch, "
        "2 chunks standing for DualPipe's two overlapped micro-batches; MLA attention (DEEPSEEK_V3_MLA)",
        attention=DEEPSEEK_V3_MLA,
    ),
    PublishedRun(
        "Llama 3 405B, 8,192 H100, bf16, TP8 PP16 DP64", LLAMA3_405B, "h100",
        Layout(tp=8, pp=16, vpp=7, schedule="interleaved_1f1b", dp_shard=64, reshard=False), 8192, 2048, None, 430.0,
        "Llama 3 paper, 4D-parallelism table: 430 TFLOP/s/GPU, 16M tokens per batch (2048 x 8192); "
        "interleaved with 7 stages per rank (at least one layer each) and FSDP without reshard assumed",
    ),
    PublishedRun(
        "Llama 3 405B, 16,384 H100, bf16, TP8 PP16 DP128", LLAMA3_405B, "h100",
        Layout(tp=8, pp=16, vpp=7, schedule="interleaved_1f1b", dp_shard=128, reshard=False), 8192, 2048, None, 400.0,
        "Llama 3 paper, 4D-parallelism table: 400 TFLOP/s/GPU, 16M tokens per batch; as the 8,192 row",
        split="held-out",
    ),
    PublishedRun(
        "Nemotron-4 340B, 6,144 H100, bf16, TP8 PP12 DP64", NEMOTRON4_340B, "h100",
        Layout(tp=8, pp=12, vpp=8, schedule="interleaved_1f1b", dp_shard=64, reshard=False), 4096, 2304,
        2304 * 4096 / 8.0 / 6144, None,
        "Nemotron-4 340B report, Table 2: batch 2304, 8.0 s per iteration on 6144 GPUs (= 192 tokens/s/GPU); "
        "one layer per virtual stage assumed, as NVIDIA's own recipe for this model",
        split="held-out",
    ),
    PublishedRun(
        "Nemotron-4 340B, 128 H100, bf16, TP8 PP8 VP12 (NGC recipe)", NEMOTRON4_340B, "h100",
        Layout(tp=8, pp=8, vpp=12, schedule="interleaved_1f1b", dp_shard=2, reshard=False), 4096, 32,
        32 * 4096 / 4.77 / 128, None,
        "NGC DGXC benchmarking, Nemotron4 340B 24.11 BF16: TP8 PP8 VP12 MBS1 GBS32, 4.77 s per step on 128 GPUs",
        split="held-out",
    ),
    PublishedRun(
        "Megatron-LM GPT 1T, 3,072 A100, fp16, TP8 PP64 (recompute)", GPT_1T, "h100",
        Layout(tp=8, pp=64, vpp=2, schedule="interleaved_1f1b", dp_shard=6, recompute=True, reshard=False), 2048,
        3072, megatron_tflops_to_tokens(163.0, 128, 25600, 2048, 51200), None,
        "Narayanan et al. 2021 (Megatron-LM), Table 1: 163 TFLOP/s/GPU (502 PFLOP/s on 3072 A100), batch 3072, "
        "activation recomputation; their FLOPs convention converted to tokens/s; 2 stages per rank assumed",
        split="held-out", gpu_spec=A100_SPEC,
    ),
    PublishedRun(
        "Megatron-Bridge Llama 3 70B, 64 H100, fp8, TP4 PP8 VP5", LLAMA3_70B, "h100",
        Layout(tp=4, pp=8, vpp=5, schedule="interleaved_1f1b", dp_shard=2, precision="fp8", reshard=False),
        8192, 128, 1619.0, 727.0,
        "github.com/NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md (since moved to "
        "performance-summary-archive.md), 25.09 container, DGX-H100: FP8 current scaling, GBS 128, "
        "MBS 1, seq 8192, TP4 PP8 VP5 CP1 (scripts/performance/configs/llama3/llama3_70b_llm_pretrain.yaml)",
        split="held-out",
    ),
    PublishedRun(
        "NeMo AutoModel DeepSeek-V3, 256 H100, bf16, PP4 EP64 (FSDP2, DeepEP)", DSV3_ONE_NODE, "h100",
        Layout(pp=4, vpp=8, schedule="interleaved_1f1b", ep=64, dp_shard=64, recompute=True, reshard=False,
               dispatch="hierarchical"),
        4096, 512, 1002.0, 250.0,
        "docs.nvidia.com/nemo/automodel/nightly/performance-summary.html (github.com/NVIDIA-NeMo/Automodel, "
        "docs/performance-summary.md), DGX-H100 BF16: GBS 512, local batch 8, GA 1, seq 4096, "
        "PP4 VP8 EP64 FSDP64, 8.18 s per step (examples/llm_benchmark/deepseek/deepseek_v3_te_deepep.yaml: "
        "interleaved 1F1B, activation checkpointing, reshard_after_forward false, DeepEP, fake balanced gate); "
        "MLA attention (DEEPSEEK_V3_MLA)",
        split="held-out", attention=DEEPSEEK_V3_MLA,
    ),
]  # fmt: skip
