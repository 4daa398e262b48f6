"""The planner against published training runs (docs/scale.md, "Calibration"):
``python -m moe.plan.calibrate`` prints the markdown table. One set of efficiencies
(`moe.plan.hardware.EFFICIENCY`) for every row; each row's layout is the published one in our
terms (Megatron's DP ranks are our ``dp_shard``, with ``ep`` folded onto them; Megatron's
distributed optimizer gathers parameters once a step, our ``reshard=0``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.llama import LlamaConfig
from .hardware import GPUS
from .layout import Layout
from .memory import TrainShape
from .time import step_time

__all__ = ["RUNS", "PublishedRun", "calibration_rows", "markdown"]


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str  # our preset
    gpu: str
    layout: Layout
    seq_len: int
    global_batch_seqs: int
    tokens_per_s_per_gpu: float | None  # published
    tflops_per_gpu: float | None  # published model TFLOP/s per GPU
    source: str


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
        Layout(pp=16, ep=64, dp_shard=128, precision="fp8", reshard=False), 4096, 15360, 1543.0, None,
        "DeepSeek-V3 report: 180K H800 hours per trillion tokens = 1543 tokens/s/GPU; batch 15360 x 4096",
    ),
]  # fmt: skip


def calibration_rows() -> list[dict]:
    rows = []
    for run in RUNS:
        cfg = LlamaConfig.from_name(run.model)
        shape = TrainShape(seq_len=run.seq_len, global_batch_tokens=run.global_batch_seqs * run.seq_len)
        t = step_time(cfg, run.layout, shape, GPUS[run.gpu])
        row = {"run": run, "tokens": t.tokens_per_s_per_gpu, "tflops": t.tflops_per_gpu, "time": t}
        published = run.tokens_per_s_per_gpu
        ours = t.tokens_per_s_per_gpu
        if published is None:  # throughput given as model TFLOP/s only: compare those
            published, ours = run.tflops_per_gpu, t.tflops_per_gpu
        row["error"] = ours / published - 1
        rows.append(row)
    return rows


def markdown() -> str:
    out = [
        "| run | layout (ours) | published tokens/s/GPU | ours | published TFLOP/s/GPU | ours | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in calibration_rows():
        run = r["run"]
        pub_tok = f"{run.tokens_per_s_per_gpu:,.0f}" if run.tokens_per_s_per_gpu else "-"
        pub_tf = f"{run.tflops_per_gpu:.0f}" if run.tflops_per_gpu else "-"
        out.append(
            f"| {run.name} | {run.layout.short()} | {pub_tok} | {r['tokens']:,.0f} | {pub_tf} | {r['tflops']:.0f} "
            f"| {r['error']:+.1%} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown())
