"""One training step of the real model measured by PyTorch's own memory trackers, set beside
the planner's estimate (`moe.plan.memory`) for the same layout and rank (docs/scale.md,
"Checking the memory model"). MoE layers route by BASE's static path (`tracked_config`): the
balanced loads the planner assumes, or with ``routing="worst"`` every token on one rank's experts;
the two-level dispatch, which reads its splits on the host, is told them for those loads
(`moe.plan.tracked_routing`).

The step: the rank's pipeline stage, built on the meta device and laid out by the real
`parallelize_llama` / `pipeline_llama` on PyTorch's fake process group (one process stands for
any rank of any world; nothing is communicated), then under ``FakeTensorMode`` (no memory is
allocated) one micro-batch's forward and backward and the AdamW step, twice (the second step
is the steady state: AdamW's state exists and the gradients are made again). Under pipelining
the stage keeps its gathered parameters and gradients through the backward and reduces them
afterwards, as `torch.distributed.pipelining` does for the last micro-batch.

``FSDPMemTracker`` (FSDP2 layouts) or ``MemTracker`` counts the live tensors by kind; each
part's peak is its largest value after any operation the tracker sees outside the optimizer step
(`_peaks`), FSDP2's all-gather and reduce-scatter buffers filed as such from their allocation
(`_fsdp_own_buffers`); the total is the tracker's peak. The parts
map onto the planner's components (`PARTS`); the planner adds the per-part peaks, which the
tracker never sees at one moment, so its total is an upper bound of the tracker's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import warnings
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..models.llama import Llama, LlamaConfig
from .layout import Layout, parse_layout
from .memory import TrainShape, memory
from .tracked_routing import ROUTINGS, _routed, _sync_free, tracked_config

__all__ = ["CASES", "PARTS", "ROUTINGS", "WORST", "Case", "compare", "measure", "planned", "table", "tracked_config"]

# planner components -> the tracker's kinds (FSDPMemTracker's names, MemTracker's in brackets)
PARTS = {
    "params": ("Sharded Param", "Parameter"),
    "buffers": ("Buffer",),  # the rotary table (the planner leaves it out: S x Dh fp32, a few MiB)
    "grads": ("Sharded Grad", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "fsdp_buffers": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
    "activations": ("Activation", "Temp", "Inputs"),  # the planner's activations + logits + moe_dispatch
}
_ACTS = ("activations", "logits", "moe_dispatch")
ADDRESS_SPACE_CAP = 16 << 30  # bytes of virtual memory the measuring process may map


def planned(cfg: LlamaConfig, lay: Layout, shape: TrainShape, rank: int) -> dict[str, int]:
    """The planner's components for ``rank`` in `PARTS` terms with one micro-batch in flight,
    as in the tracked step (the planner's live-chunk factor of a pipeline schedule is one)."""
    one = TrainShape(seq_len=shape.seq_len, global_batch_tokens=shape.seq_len * lay.micro_batch * lay.dp)
    mem = memory(cfg, lay, one, rank)
    out = {k: mem[k] for k in PARTS if k not in ("activations", "buffers")}
    out["buffers"] = cfg.max_seq_len * 2 * cfg.head_dim * 4  # the rotary table (S, 2, Dh) fp32
    out["activations"] = sum(mem[k] for k in _ACTS)
    out["total"] = sum(out[k] for k in PARTS)
    return out


def _mesh(lay: Layout, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..parallel.layout import LlamaMesh

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world)
    dims = ("pp", "dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", tuple(getattr(lay, d) for d in dims), mesh_dim_names=dims)
    return LlamaMesh.build(mesh, ep=lay.ep)


def _stage(cfg: LlamaConfig, lay: Layout, lm, shape: TrainShape, options: dict):
    """This rank's stage module, laid out (the whole model without pipelining)."""
    from ..parallel import parallelize_llama, pipeline_llama

    with torch.device("meta"):
        model = Llama(cfg)
    if lay.pp == 1:
        return parallelize_llama(model, lm, ep=lay.ep, etp=lay.etp, loss_parallel=lay.loss_parallel, **options)
    if lay.vpp > 1:
        raise ValueError("the tracked step runs one stage per rank (vpp=1)")
    pipe = pipeline_llama(
        model, lm, schedule=lay.schedule, microbatches=shape.microbatches(lay), ep=lay.ep, etp=lay.etp, **options
    )
    return pipe.models[0]


def _reduce_like_pipeline(module) -> None:
    """What `torch.distributed.pipelining`'s stage does after the last micro-batch's backward:
    FSDP's post-backward of every group (reduce-scatter, reshard), then its final callback."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _one_step(model, lay: Layout, cfg: LlamaConfig, shape: TrainShape, opt, fsdp: bool) -> None:
    from ..parallel.llama import llama_loss, loss_context

    first, last = model.tok_embeddings is not None, model.output is not None
    b, s = lay.micro_batch, shape.seq_len
    piped = lay.pp > 1 and fsdp
    if piped:  # the pipeline's no-sync backward: gathered parameters and gradients are kept
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
    dtype = torch.bfloat16 if lay.precision != "fp32" else torch.float32
    autocast = torch.autocast("cpu", dtype) if not fsdp and dtype != torch.float32 else contextlib.nullcontext()
    tokens = torch.randint(0, cfg.vocab_size, (b, s))
    x = tokens if first else torch.empty(b, s // lay.tp, cfg.dim, dtype=dtype, requires_grad=True)
    with autocast, loss_context(model):
        out = model(x)
        if last and lay.pp > 1:
            loss = F.cross_entropy(out.flatten(0, 1).float(), tokens.flatten())
        elif last:
            loss = llama_loss(model, out, tokens)
        if last:
            loss.backward()
        else:
            out.backward(torch.empty_like(out))
    if piped:
        _reduce_like_pipeline(model)
    opt.step()
    opt.zero_grad()


def measure(
    cfg: LlamaConfig, lay: Layout, shape: TrainShape, rank: int, *, routing: str = "balanced", **options
) -> dict[str, int]:
    """{part of `PARTS`: its peak bytes, "total": the tracker's peak} of the global ``rank``
    running one step under ``lay``. ``options``: more `parallelize_llama` keywords (the
    layout's ``dispatch`` and ``chunks`` unless given; ``ranks_per_node`` for the two-level
    dispatch). Runs in a fresh process (DTensor caches plans per mesh, and a
    second fake process group in one process would meet them), its address space capped at
    `ADDRESS_SPACE_CAP` so that a tensor made real by mistake fails instead of filling the host."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    options = {"dispatch": lay.dispatch, "chunks": lay.chunks, **options}
    if cfg.moe is not None and options["dispatch"] == "hierarchical" and options.get("ranks_per_node") is None:
        raise ValueError(
            "the two-level dispatch's tracked step needs ranks_per_node (the ep ranks per node: the "
            "process that measures has no torchrun environment to find it from)"
        )
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=_cap_memory) as pool:
        return pool.submit(_measure_here, cfg, lay, shape, rank, options, routing).result()


def _cap_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))
    warnings.simplefilter("ignore", UserWarning)  # torch's notes on fake meshes and hooks, for every rank


def _measure_here(
    cfg: LlamaConfig, lay: Layout, shape: TrainShape, rank: int, options: dict, routing: str = "balanced"
) -> dict[str, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if lay.precision == "fp8":
        raise ValueError("the tracked step runs bf16 or fp32 (fp8 GEMMs need a GPU)")
    options = dict(options, activation_checkpoint=lay.recompute, reshard_after_forward=lay.reshard)
    cfg = tracked_config(cfg)
    if cfg.moe is not None and options.get("dispatch") != "hierarchical":  # which has no static path
        options["static_splits"] = True
    if lay.dp > 1 and lay.precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    lm = _mesh(lay, rank)
    try:
        model = _stage(cfg, lay, lm, shape, options)
        _sync_free(model)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")  # no init: fake values are never read (and BASE's
            # orthogonal init of a sharded DTensor has no sharding rule for its in-place transpose)
            decay = [p for p in model.parameters() if p.dim() >= 2]
            rest = [p for p in model.parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-4)
            fsdp = isinstance(model, FSDPModule)
            if fsdp:
                tracker = _peaks(FSDPMemTracker)(model, opt)
            else:
                tracker = _peaks(MemTracker)()
                tracker.track_external(model, opt)
            filed = _fsdp_own_buffers(tracker) if fsdp else contextlib.nullcontext()
            with tracker, filed, _private_propagation(), _routed(model, routing, lay.coords(rank)["ep"]):
                _one_step(model, lay, cfg, shape, opt, fsdp)
                if fsdp:
                    _file_unsharded_grads(model, tracker)
                tracker.reset_mod_stats()  # the snapshots of the steady-state step only
                _one_step(model, lay, cfg, shape, opt, fsdp)
            return _parts(tracker)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _private_propagation():
    """DTensor learns each op's output shape by running it on global-shape fake tensors in the
    fake mode it finds active; under our FakeTensorMode the tracker would count those
    (a whole unsharded weight for each op of the optimizer step). A fake mode of their own
    makes the tracker skip them, as it does in eager runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    own = FakeTensorMode()
    with mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *a: own):
        yield


def _peaks(tracker_class):
    """``tracker_class`` keeping each part's largest value after every operation it tracks outside
    the optimizer step (its snapshots are taken at module boundaries and at the total's peaks,
    and miss a part's peak between them: the logits' gradient before the first module's
    backward, FSDP2's copy-in), in ``part_peaks`` since the last ``reset_mod_stats``; and filing
    a new tensor under ``filing`` when set (`_fsdp_own_buffers`). The step's temporaries are left
    out: AdamW's for-loop on these CPU tensors makes two fp32 copies of one parameter at a time
    (a GPU's foreach step one per element of a group), at a moment no activations are live."""

    class Tracker(tracker_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.part_peaks: dict[str, int] = {}
            self.filing = None

        def _track(self, reftype, t):
            super()._track(self.filing or reftype, t)

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            if self._in_opt:
                return
            for dev in self._curr_mem_snap.values():
                for part, kinds in PARTS.items():
                    self.part_peaks[part] = max(self.part_peaks.get(part, 0), sum(dev.get(k, 0) for k in kinds))

        def reset_mod_stats(self):
            super().reset_mod_stats()
            self.part_peaks = {}

    return Tracker


@contextlib.contextmanager
def _fsdp_own_buffers(tracker):
    """FSDP2's own buffers filed as FSDP buffers from their allocation: what its all-gather and
    copy-out make ("All Gather"), what its reduce-scatter copy-in makes ("Reduce Scatter": the
    fp32 input and the dim-0 copies of gradients sharded on another dim), and the fp32 gradients
    it accumulates unsharded while gradient sync is off ("Unsharded Grad": under pipelining). The
    tracker files them as Temp: the all-gather output and the reduce-scatter input until the
    collective is issued (by then the copy-in has freed the gradients it copied: the two are never
    seen together, though they are live together), the accumulated gradients always."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType as Ref
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    def filed(fn, reftype):
        def inner(*args, **kwargs):
            tracker.filing = reftype
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.filing = None

        return inner

    makers = [
        (group, "foreach_all_gather", Ref.ALL_GATHER),
        (group, "foreach_all_gather_copy_out", Ref.ALL_GATHER),
        (group, "foreach_reduce", Ref.REDUCE_SCATTER),
        (FSDPParam, "to_accumulated_grad_if_needed", Ref.UNSHARDED_GRAD),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, reftype in makers:
            stack.enter_context(mock.patch.object(owner, name, filed(getattr(owner, name), reftype)))
        yield


def _file_unsharded_grads(model, tracker) -> None:
    """Autograd's gradient of each unsharded parameter filed as "Unsharded Grad" when it is
    accumulated, not when FSDP2's post-backward takes it (the tracker's moment): until then the
    tracker files it as Temp, our activations. The unsharded parameters exist from the first
    all-gather on, and are the same tensors in every step."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    def file(param):
        tracker._update_and_maybe_create_winfos(param.grad, _FSDPRefType.UNSHARDED_GRAD)

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group else ():
            fsdp_param._unsharded_param.register_post_accumulate_grad_hook(file)


def _parts(tracker) -> dict[str, int]:
    snaps = [tracker.get_tracker_snapshot("peak")]
    for stats in tracker.memory_tracking.values():
        for per_state in stats.snapshots.values():
            snaps += per_state
    out = dict.fromkeys(PARTS, 0)
    total = 0
    for snap in snaps:
        for dev in snap.values():
            total = max(total, dev.get("Total", 0))
            for part, kinds in PARTS.items():
                out[part] = max(out[part], sum(dev.get(k, 0) for k in kinds))
    out = {part: max(v, tracker.part_peaks.get(part, 0)) for part, v in out.items()}
    out["total"] = total
    return out


def compare(cfg: LlamaConfig, lay: Layout, shape: TrainShape, rank: int, **options) -> dict[str, tuple[int, int]]:
    """{part and "total": (planned bytes, measured bytes)} for ``rank``."""
    got = measure(cfg, lay, shape, rank, **options)
    want = planned(cfg, lay, shape, rank)
    return {k: (want[k], got[k]) for k in (*PARTS, "total")}


def check_memory_report(
    cfg: LlamaConfig, lay: Layout, shape: TrainShape, rank: int, usable: float, gpus_per_node: int
) -> str:
    """The lines ``moe plan --check-memory`` prints: per part, planned and measured GiB (the
    two-level dispatch over nodes of ``gpus_per_node``, as the planner's time takes them)."""
    from .dispatch_time import ep_ranks_per_node

    two_level = {"ranks_per_node": ep_ranks_per_node(lay, gpus_per_node)} if lay.dispatch == "hierarchical" else {}
    got = compare(cfg, lay, shape, rank, **two_level)
    lines = [f"tracked step of rank {rank} (one micro-batch; PyTorch's memory tracker), GiB planned / measured:"]
    for k, (want, have) in got.items():
        lines.append(f"  {k:<14}{want / 2**30:>9.2f}{have / 2**30:>9.2f}  ({have / max(want, 1):.2f})")
    verdict = "within" if got["total"][1] <= usable else "OVER"
    lines.append(f"measured peak {got['total'][1] / 2**30:.2f} GiB: {verdict} the {usable / 2**30:.1f} GiB usable")
    return "\n".join(lines)


@dataclass(frozen=True)
class Case:
    """One row of the table: a preset at its real widths, a layout of a 1024+ rank world, the
    pipeline rank measured, and fewer layers where the whole depth would take minutes (the
    planner is given the same depth: every layer of a kind is alike)."""

    model: str
    layout: str
    pp_rank: int = 0
    n_layers: int | None = None
    seq_len: int = 4096
    differs: tuple[str, ...] = ()  # parts allowed past 10%, summed and compared (docs/scale.md says why)
    options: tuple = ()  # more parallelize_llama keywords, as (name, value) pairs
    routing: str = "balanced"  # the MoE loads (`ROUTINGS`); "worst" is outside what the planner assumes

    def setup(self) -> tuple[LlamaConfig, Layout, TrainShape, int]:
        over = {"n_layers": self.n_layers} if self.n_layers else {}
        cfg = LlamaConfig.from_name(self.model, **over)
        lay = parse_layout(self.layout)
        m = 2 * lay.pp  # micro-batches of the step (the tracked step runs one)
        shape = TrainShape(seq_len=self.seq_len, global_batch_tokens=self.seq_len * lay.micro_batch * lay.dp * m)
        return cfg, lay, shape, lay.rank(pp=self.pp_rank)

    def name(self) -> str:
        stage = f", pipeline rank {self.pp_rank}" if parse_layout(self.layout).pp > 1 else ""
        depth = f", {self.n_layers} layers" if self.n_layers else ""
        extra = "".join(f", {k}={v}" for k, v in self.options)
        loads = ", worst-case loads" if self.routing == "worst" else ""
        return f"{self.model}{depth}: {self.layout}{extra}{stage}{loads}"


_NODES_OF_4, _NODES_OF_8 = (("ranks_per_node", 4),), (("ranks_per_node", 8),)  # ep ranks a node
_PIPE = ("fsdp_buffers", "activations")  # the first stage's embedding gradient, a short stage's backward: docs/scale.md
CASES = [
    Case("llama2-70b", "tp=8,dp_shard=128", n_layers=4),
    Case("llama2-70b", "tp=8,dp_shard=128,reshard=0", n_layers=4),
    Case("llama2-70b", "tp=8,dp_shard=128,recompute=1", n_layers=4, differs=("activations",)),
    Case("llama2-70b", "tp=8,pp=8,dp_shard=16", pp_rank=0, differs=_PIPE),
    Case("llama2-70b", "tp=8,pp=8,dp_shard=16", pp_rank=4),
    Case("llama2-70b", "tp=8,pp=8,dp_shard=16", pp_rank=7),
    Case("llama2-7b", "dp_shard=1024", n_layers=4),  # tp = 1: the root is larger than a block
    # MoE (routed by BASE's static path: `tracked_config`)
    Case("mixtral-8x7b", "tp=2,ep=8,dp_shard=512", n_layers=2),
    Case("mixtral-8x7b", "tp=2,ep=8,etp=1,dp_shard=512", n_layers=2),
    Case("mixtral-8x7b", "tp=8,dp_shard=128", n_layers=2),  # ep=1: the experts in the block's unit
    Case("mixtral-8x7b", "tp=8,etp=1,dp_shard=128", n_layers=2),
    Case("llama2-moe-1.2t", "tp=4,pp=16,ep=8,etp=1,dp_shard=16,reshard=0", pp_rank=1, n_layers=32, differs=_PIPE),
    # the two-level dispatch, its ep group over nodes of 8 GPUs (its splits told on the host: `_routed`)
    Case("mixtral-8x7b", "tp=2,ep=8,dp_shard=512,dispatch=hierarchical", n_layers=2, options=_NODES_OF_4),
    Case("mixtral-8x7b", "tp=2,ep=8,dp_shard=512,dispatch=hierarchical,chunks=2", n_layers=2, options=_NODES_OF_4),
    Case("deepseek-v3-like", "ep=64,dp_shard=1024,dispatch=hierarchical", n_layers=5, options=_NODES_OF_8),
    Case("deepseek-v3-like", "ep=64,dp_shard=1024,dispatch=hierarchical,chunks=2", n_layers=5, options=_NODES_OF_8),
]
# dropless routing at its worst: every token of the ep group to one rank's experts (not a case the
# planner covers: docs/scale.md)
WORST = Case("mixtral-8x7b", "tp=2,ep=8,dp_shard=512", n_layers=2, routing="worst")


def table(cases=CASES) -> str:
    """The markdown table of docs/scale.md: planned and measured MiB per part, and their ratio."""
    head = ["case", *PARTS, "total", "planner >= tracker"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        cfg, lay, shape, rank = case.setup()
        got = compare(cfg, lay, shape, rank, routing=case.routing, **dict(case.options))
        cells = [case.name()]
        for k in (*PARTS, "total"):
            want, have = got[k]
            cells.append(f"{want / 2**20:,.0f} / {have / 2**20:,.0f} ({have / max(want, 1):.2f})")
        cells.append("yes" if got["total"][0] >= got["total"][1] else "**NO**")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m moe.plan.memcheck: the table of docs/scale.md
    print(table([*CASES, WORST]))
