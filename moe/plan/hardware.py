"""GPU presets and the efficiency assumptions of the time model (docs/scale.md, "Time").

Peaks are the vendors' dense (no sparsity) tensor-core figures of the SXM parts; bandwidths
are per GPU and per direction: NVLink within a node, the network (one 400 Gb/s NIC per GPU on
the usual 8-GPU nodes) between nodes. HBM bytes are what the driver reports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["EFFICIENCY", "GPUS", "Efficiency", "GPU", "gpu_from_spec"]


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    hbm_bytes: int
    bf16_flops: float  # dense peak, FLOP/s
    fp8_flops: float
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s per GPU, one direction
    net_bw: float  # bytes/s per GPU between nodes, one direction

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"GPU {f.name} must be a positive number, got {v!r}")


_MIB = 1 << 20
GPUS: dict[str, GPU] = {
    "h100": GPU(name="h100", hbm_bytes=81559 * _MIB, bf16_flops=989e12, fp8_flops=1979e12, hbm_bw=3.35e12,
                nvlink_bw=450e9, net_bw=50e9),
    "h200": GPU(name="h200", hbm_bytes=143771 * _MIB, bf16_flops=989e12, fp8_flops=1979e12, hbm_bw=4.8e12,
                nvlink_bw=450e9, net_bw=50e9),
    # the export part DeepSeek-V3 was trained on: H100 compute, NVLink cut to 400 GB/s both ways
    "h800": GPU(name="h800", hbm_bytes=81559 * _MIB, bf16_flops=989e12, fp8_flops=1979e12, hbm_bw=3.35e12,
                nvlink_bw=200e9, net_bw=50e9),
}  # fmt: skip


def gpu_from_spec(name: str, spec: str | None = None) -> GPU:
    """A preset, optionally with fields overridden: ``gpu_from_spec("h100", "hbm_bytes=96e9,net_bw=25e9")``."""
    if name not in GPUS:
        raise ValueError(f"unknown --gpu {name!r}; presets: {sorted(GPUS)} (override fields with --gpu-spec)")
    gpu = GPUS[name]
    if not spec:
        return gpu
    fields = {f.name for f in dataclasses.fields(GPU)} - {"name"}
    over = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"--gpu-spec key {key!r} is not one of {sorted(fields)}")
        try:
            over[key] = float(value)
        except ValueError:
            raise ValueError(f"--gpu-spec {key} must be a number, got {value!r}") from None
    if "hbm_bytes" in over:
        over["hbm_bytes"] = int(over["hbm_bytes"])
    return dataclasses.replace(gpu, name=f"{name}*", **over)


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of the peaks a well-tuned step reaches; one set for every layout and model.
    The defaults are the prior the fit starts from; `EFFICIENCY` is the fitted set."""

    gemm: float = 0.75  # large bf16 GEMMs, of the bf16 dense peak
    gemm_fp8: float = 0.6  # fp8 GEMMs (with their scaling), of the fp8 dense peak
    attention: float = 0.5  # flash attention forward + backward, of the bf16 peak
    hbm: float = 0.7  # elementwise kernels (norms, rope, activations, permutes), of HBM bandwidth
    nvlink: float = 0.75  # collectives inside a node
    net: float = 0.7  # collectives and point-to-point between nodes


# fitted on the "fit" rows of moe/plan/runs.py only (`python -m moe.plan.calibrate --fit`,
# docs/scale.md); attention and net sit at the top of their allowed ranges
EFFICIENCY = Efficiency(gemm=0.625, gemm_fp8=0.7, attention=0.7, net=0.9)
