"""The MoE layer against its peers over a grid of shapes, forward + backward (fp32 on CPU by
default; ``--device cuda --dtype bfloat16`` on a GPU).

    python -m benchmarks.layer_grid                      # the small points (D/F = 256/512)
    python -m benchmarks.layer_grid --points small mid   # and D/F = 1024/2816 at T <= 2048
    python -m benchmarks.layer_grid --T 2048 --D 256 --F 512 --E 8 --K 2   # one point
    python -m benchmarks.layer_grid --apart --touch 64   # each alone; 64 MiB of fresh memory between steps
    python -m benchmarks.layer_grid --T 2048 --D 1024 --F 2816 --E 64 --K 8 --profile --gemms   # where the time goes

At every point the contenders take turns within each repeat (one warm-up each, then
--repeats), and the table gives each one's median ms, the min-max spread, and the ratios the
goals are stated in: ours / torchtitan, ours / Megatron, ours / the dense-equivalent SwiGLU
(T*K tokens through one expert: the same GEMM FLOPs in three plain matmuls, the floor).

- ours: `moe.MoE`, softmax top-K renormalised (what torchtitan's `route_norm` and Mixtral do),
  and `ours BASE` with the exact balanced assignment (no peer has it: compare with the floor);
  `ours whole-row` is `ours` with its SwiGLU experts always in the whole-row form (three
  `grouped_mm` over all rows), never one expert at a time (`moe.kernels.expert_ffn`);
  `ours 2 GiB kept` (run only when named in --only) is `ours` with kept memory of its own,
  limited to 2 GiB (the limit's default before it was a quarter of the machine's memory:
  `moe.kernels.workspace`);
- torchtitan 0.3's `MoE` (softmax top-K, `route_norm`, its grouped experts);
- Megatron-core 0.16's `MoELayer` (softmax top-K, all-gather dispatcher, SequentialMLP: its
  GroupedMLP needs the grouped_gemm package) through the test-only CPU shims;
- transformers' `MixtralSparseMoeBlock`, its eager and grouped_mm experts.
All hold weights drawn N(0, 0.02) and read the same (T, D) input. The load average is printed
before and after: take figures only when both are under 0.3.

Taking turns, each contender runs just after the others, in the caches and the allocator they
left; ``--apart`` runs each one's repeats back to back instead, as if alone, and ``--touch``
makes and frees fresh memory before every step, as the rest of a model would.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.adapters import _titan_moe
from benchmarks.common import run_meta, timed_turns, train_step
from moe import MoE, MoEConfig

POINTS = {
    "small": [(t, 256, 512, e, k) for t in (512, 2048, 8192) for e, k in ((8, 2), (64, 8))],
    "mid": [(t, 1024, 2816, e, k) for t in (512, 2048) for e, k in ((8, 2), (64, 8))],
    "mid8k": [(8192, 1024, 2816, e, k) for e, k in ((8, 2), (64, 8))],
    "big": [(512, 4096, 14336, 8, 2)],
}
DENSE = "dense SwiGLU"


def _ours(d, f, e, k, router="topk"):
    options = {"renormalize": True} if router == "topk" else {}  # softmax top-K (the default scores)
    layer = MoE(MoEConfig(dim=d, hidden_dim=f, num_experts=e, top_k=k, router=router, router_options=options))
    return lambda x: layer(x[None])[0], layer


def _ours_whole_row(d, f, e, k):
    from moe.kernels import expert_ffn

    run, layer = _ours(d, f, e, k)

    def whole_row(x):  # the form is chosen in the forward; the backward follows it
        kept, expert_ffn.DTYPES = expert_ffn.DTYPES, ()
        try:
            return run(x)
        finally:
            expert_ffn.DTYPES = kept

    return whole_row, layer


@contextlib.contextmanager
def _own_kept(pool, limit: int):
    """The calls inside run with ``pool`` as this thread's kept blocks of `moe.kernels.workspace`
    and ``limit`` as the limit (the module's state, swapped in and back: the blocks are the
    thread's, the limit is the process's, which suits this one-thread benchmark), so one
    contender's kept memory is not another's."""
    from moe.kernels import workspace

    saved = workspace._local.__dict__.get("kept"), workspace._limit[0]
    workspace._local.kept, workspace._limit[0] = pool, limit
    try:
        yield
    finally:
        workspace._local.__dict__.pop("kept", None)
        if saved[0] is not None:
            workspace._local.kept = saved[0]
        workspace._limit[0] = saved[1]


def _ours_kept(d, f, e, k, limit: int = 2 << 30):
    from moe.kernels import workspace

    run, layer = _ours(d, f, e, k)
    pool = workspace._Kept()
    return run, layer, lambda: _own_kept(pool, limit)


def _titan(d, f, e, k):
    module = _titan_moe(d, f, e, k)
    return lambda x: module(x[None])[0], module


def _megatron(d, f, e, k):
    import torch.distributed as dist

    from tests.adapters import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    cfg = megatron_cpu.moe_layer_config(dim=d, hidden=f, experts=e, top_k=k)
    module = MoELayer(cfg, get_gpt_layer_local_spec(num_experts=e, moe_grouped_gemm=False).submodules.mlp.submodules)
    return lambda x: module(x[:, None])[0][:, 0], module  # Megatron's [s, b, h]


def _mixtral(d, f, e, k, impl):
    from transformers.models.mixtral import modeling_mixtral as mm

    cfg = mm.MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
    cfg._experts_implementation = impl
    module = mm.MixtralSparseMoeBlock(cfg)
    for p in module.parameters():
        nn.init.normal_(p, std=0.02)

    def run(x):
        out = module(x[None])
        return (out[0] if isinstance(out, tuple) else out)[0]

    return run, module


def _dense(d, f, e, k):
    w1, w3 = (nn.Parameter(torch.randn(d, f) * 0.02) for _ in range(2))
    w2 = nn.Parameter(torch.randn(f, d) * 0.02)
    holder = nn.ParameterList([w1, w3, w2])

    def run(x):
        x2 = x.repeat(k, 1)  # T*K tokens through one expert: the routed GEMMs' FLOPs
        return (F.silu(x2 @ w1) * (x2 @ w3)) @ w2

    return run, holder


CONTENDERS = {
    "ours": _ours,
    "ours BASE": lambda d, f, e, k: _ours(d, f, e, k, router="base"),
    "ours whole-row": _ours_whole_row,
    "ours 2 GiB kept": _ours_kept,
    "torchtitan": _titan,
    "Megatron": _megatron,
    "Mixtral eager": lambda d, f, e, k: _mixtral(d, f, e, k, "eager"),
    "Mixtral grouped_mm": lambda d, f, e, k: _mixtral(d, f, e, k, "grouped_mm"),
    DENSE: _dense,
}
OPT_IN = {"ours 2 GiB kept"}  # run only when --only names them


def _chosen(name: str, only) -> bool:
    return name in only if only else name not in OPT_IN


def columns(only) -> list[str]:
    """The contenders a table shows: all but the opt-in ones --only does not name."""
    return [name for name in CONTENDERS if name not in OPT_IN or _chosen(name, only)]


def _make(make, d, f, e, k):
    """A contender's (run, module, scope): ``scope()`` is a context for its whole step."""
    made = make(d, f, e, k)
    return (*made, contextlib.nullcontext)[:3]


def _touch(mib: int):
    """Make, write and free ``mib`` MiB of fresh memory: what the rest of a model (attention,
    other layers) does between two calls of the layer."""
    if not mib:
        return None
    return lambda: torch.ones(mib << 18).add_(1.0)  # float32: 2**18 numbers a MiB


def _step(scope, run, module, x, backward_range=None) -> None:
    with scope():
        train_step(run, module, x, backward_range)


def point(t, d, f, e, k, repeats, only, device="cpu", dtype=torch.float32, apart=False, touch=0):
    torch.manual_seed(0)
    x = torch.randn(t, d, device=device, dtype=dtype)
    fns = {}
    for name, make in CONTENDERS.items():
        if not _chosen(name, only):
            continue
        try:
            run, module, scope = _make(make, d, f, e, k)
            module.to(device, dtype)
            fns[name] = lambda run=run, module=module, scope=scope: _step(scope, run, module, x)
        except Exception as err:  # a peer this install lacks: say so, compare the rest
            print(f"skip {name} at T={t} D={d} F={f} E={e} K={k}: {type(err).__name__}: {err}", file=sys.stderr)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    times = timed_turns(fns, repeats, sync, before=_touch(touch), apart=apart)
    med = {n: statistics.median(ts) for n, ts in times.items()}

    def ratio(a, b):
        return f"{med[a] / med[b]:.2f}" if a in med and b in med else "-"

    cells = " | ".join(
        f"{med[n] * 1e3:.1f} ({min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f})" if n in med else "-"
        for n, ts in ((n, times.get(n, [])) for n in columns(only))
    )
    return (
        f"| {t} | {d}/{f} | {e}/{k} | {cells} | {ratio('ours', 'torchtitan')} | {ratio('ours', 'Megatron')} "
        f"| {ratio('ours', DENSE)} | {ratio('ours BASE', DENSE)} |"
    )


GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")
BACKWARD = "layer_grid::backward"


def _matrices(name: str, shapes):
    """The two matrices of a GEMM's input shapes: addmm's bias and scalars and an ``out=``
    tensor left out."""
    return [s for s in shapes[name == "aten::addmm" :] if len(s) >= 2][:2]


def gemm_role(matrices, widths: set[int], backward: bool) -> str:
    """Which GEMM of a layer a (M, K) x (K, N) call is, from its two matrices' shapes
    (`_matrices`): ``forward`` and ``dX`` make rows x a width; ``dW`` sums over the rows into a
    weight, both of whose sides are among ``widths`` (D, F, 2F where gate and up are one
    matrix, E for the router). A dX whose rows equal a width reads as dW."""
    (*_, m, _), (*_, n) = matrices
    return "dW" if backward and m in widths and n in widths else ("dX" if backward else "forward")


def gemm_roles(events, widths: set[int], steps: int) -> dict[str, tuple[float, float, float]]:
    """Per role (`gemm_role`): calls, self CPU ms and GFLOP a step, from a profile recorded
    with shapes over `train_step`s whose backward is in a `BACKWARD` range."""
    spans = [(ev.time_range.start, ev.time_range.end) for ev in events if ev.name == BACKWARD]
    roles: dict[str, list[float]] = {}
    for ev in events:
        matrices = _matrices(ev.name, ev.input_shapes) if ev.name in GEMMS else []
        if len(matrices) < 2:
            continue
        start = ev.time_range.start
        role = gemm_role(matrices, widths, any(a <= start <= b for a, b in spans))
        (*batch, m, kk), (*_, n) = matrices
        acc = roles.setdefault(role, [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += ev.self_cpu_time_total / 1e3
        acc[2] += 2 * m * kk * n * (batch[0] if batch else 1) / 1e9
    return {role: tuple(v / steps for v in acc) for role, acc in sorted(roles.items())}


def profile_point(t, d, f, e, k, only, steps: int = 5, dtype=torch.float32, gemms=None) -> list[str]:
    """Where a forward + backward's time goes, per contender: torch.profiler's self CPU time per
    step, split into the GEMMs and everything else, and the aten calls (after 3 warm-up steps).
    With a list as ``gemms``, each contender's GEMMs by role go into it as rows (contender, role,
    calls, ms, GFLOP and GFLOP/s a step)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    x = torch.randn(t, d, dtype=dtype)
    lines = []
    for name, make in CONTENDERS.items():
        if not _chosen(name, only):
            continue
        run, module, scope = _make(make, d, f, e, k)
        module.to(dtype=dtype)
        for _ in range(3):
            _step(scope, run, module, x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=gemms is not None) as prof:
            for _ in range(steps):
                _step(scope, run, module, x, BACKWARD)
        events = prof.key_averages()
        total = sum(ev.self_cpu_time_total for ev in events if ev.key != BACKWARD) / steps / 1e3
        gemm = sum(ev.self_cpu_time_total for ev in events if ev.key in GEMMS) / steps / 1e3
        calls = sum(ev.count for ev in events if ev.key.startswith("aten::")) / steps
        lines.append(f"| {name} | {total:.1f} | {gemm:.1f} | {total - gemm:.1f} | {calls:.0f} |")
        if gemms is not None:
            for role, (n, ms, gflop) in gemm_roles(prof.events(), {d, f, 2 * f, e}, steps).items():
                gemms.append(f"| {name} | {role} | {n:.0f} | {ms:.1f} | {gflop:.3f} | {gflop / ms * 1e3:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="+", default=["small"], choices=sorted(POINTS))
    for dim in ("T", "D", "F", "E", "K"):
        ap.add_argument(f"--{dim}", type=int, default=None, help="with all five: one point instead of --points")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--only", nargs="+", default=None, choices=sorted(CONTENDERS), help="these contenders only")
    ap.add_argument("--profile", action="store_true", help="with one point: where each contender's time goes")
    ap.add_argument("--gemms", action="store_true", help="with --profile: each contender's GEMMs by pass and role")
    ap.add_argument(
        "--apart", action="store_true", help="each contender's repeats back to back, not taking turns (as if alone)"
    )
    ap.add_argument(
        "--touch", type=int, default=0, metavar="MIB", help="make, write and free MIB MiB of memory before every run"
    )
    args = ap.parse_args(argv)
    one = (args.T, args.D, args.F, args.E, args.K)
    if any(v is not None for v in one) and None in one:
        ap.error("one point needs all of --T --D --F --E --K")
    points = [one] if None not in one else [p for name in args.points for p in POINTS[name]]
    if args.gemms and not args.profile:
        ap.error("--gemms goes with --profile")
    meta = run_meta("benchmarks.layer_grid", argv, torch.device(args.device))
    if args.profile:
        if None in one or args.device != "cpu":
            ap.error("--profile takes one point (--T --D --F --E --K) on the CPU")
        print(f"`{meta['command']}`: {meta['threads']} threads, {meta['date']}, load before {os.getloadavg()[0]:.2f}\n")
        print("| contender | self CPU ms a step | GEMMs | the rest | aten calls |\n|---|---:|---:|---:|---:|")
        gemms = [] if args.gemms else None
        print("\n".join(profile_point(*one, args.only, dtype=getattr(torch, args.dtype), gemms=gemms)))
        if gemms:
            head = "| contender | GEMMs | calls a step | ms a step | GFLOP a step | GFLOP/s |"
            print("\n" + "\n".join([head, "|---|---|---:|---:|---:|---:|", *gemms]))
        print(f"\nload after {os.getloadavg()[0]:.2f}")
        return
    print(
        f"`{meta['command']}`: {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, {meta['date']}, "
        f"load before {os.getloadavg()[0]:.2f}; median ms of {args.repeats} (min-max), forward + backward\n"
    )
    print(
        "| T | D/F | E/K | " + " | ".join(columns(args.only)) + " | ours / torchtitan | ours / Megatron | ours / dense "
        "| ours BASE / dense |"
    )
    print("|" + "---|" * (3 + len(columns(args.only)) + 4))
    for p in points:
        row = point(*p, args.repeats, args.only, args.device, getattr(torch, args.dtype), args.apart, args.touch)
        print(row, flush=True)
    print(f"\nload after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
