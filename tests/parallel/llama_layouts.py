"""Shared by the Llama layout tests: the tiny model, the one-process reference and the check
that a parallel layout's three AdamW steps equal it.

The rule both sides follow: the global batch (B, S) is cut into C = Dp x M equal chunks of
consecutive rows (Dp data-parallel ranks, M micro-batches each); a chunk's loss is its mean
token cross entropy plus the router losses of its tokens (routed together, as one process
routes one forward); the step's loss is the mean of the C chunk losses. The reference runs the
C chunks one after another in one process and steps AdamW on the accumulated gradient.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from moe import MoEConfig, aux_loss
from moe.models import Llama, LlamaConfig

ROUTERS = {
    "base": dict(router="base", top_k=1, combine="sigmoid_residual"),
    "topk": dict(router="topk", top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001),
}
BATCH, SEQ, STEPS = 8, 8, 3
TOL = dict(rtol=1e-5, atol=5e-6)  # fp32; parameters are ~2e-2 and move by ~1e-2 per step: atol is 2.5e-4 of them


def config(router: str, n_layers: int = 2, num_experts: int = 4, **overrides) -> LlamaConfig:
    moe = MoEConfig(dim=32, hidden_dim=48, num_experts=num_experts, **ROUTERS[router])
    fields = dict(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=64)
    return LlamaConfig(**(fields | dict(max_seq_len=SEQ, moe=moe, moe_every=2) | overrides))


def build(cfg: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def data(cfg: LlamaConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def optimizer(params) -> torch.optim.Optimizer:
    # Adam moves an entry by about lr * g / (|g| + eps): eps bounds how much it amplifies the
    # rounding noise of a gradient that is ~0 (lr / eps = 100)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.1)


def reference(cfg: LlamaConfig, chunks: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: losses of STEPS steps, the gradients of the first, the parameters after them."""
    model = build(cfg)
    opt = optimizer(model.parameters())
    losses, grads = [], {}
    for step in range(STEPS):
        tokens, targets = data(cfg, step)
        total = 0.0
        for x, y in zip(tokens.chunk(chunks), targets.chunk(chunks), strict=True):
            logits = model(x)
            loss = (F.cross_entropy(logits.flatten(0, 1), y.flatten()) + aux_loss(model)) / chunks
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


_REFERENCES: dict = {}


def cached_reference(cfg: LlamaConfig, chunks: int):
    key = (repr(cfg), chunks)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(cfg, chunks)
    return _REFERENCES[key]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def strip(name: str) -> str:
    """A parameter name without wrappers' prefixes (checkpointing, compile)."""
    for part in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    return name


def check_params(what: str, params: dict[str, torch.Tensor], expect: dict[str, torch.Tensor], complete=True) -> None:
    if complete:
        assert sorted(strip(n) for n in params) == sorted(expect), f"{what}: other parameters than the reference's"
    for name, p in params.items():
        torch.testing.assert_close(
            full(p.detach()), expect[strip(name)], **TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def check_grads(what: str, model, expect: dict[str, torch.Tensor]) -> None:
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    check_params(f"{what} first step's gradient of", grads, expect, complete=False)


def check_losses(what: str, losses: list[float], expect: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expect), **TOL, msg=lambda m: f"{what} losses: {m}")


def run_parallel(cfg: LlamaConfig, mesh, what: str, **options) -> None:
    """STEPS steps of the model laid out by parallelize_llama equal the one-process reference."""
    from moe.parallel import LlamaMesh, llama_loss, loss_context, parallelize_llama

    lm = mesh if isinstance(mesh, LlamaMesh) else LlamaMesh.build(mesh, ep=options.pop("ep", 1))
    model = parallelize_llama(build(cfg), lm, **options)
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        tokens, targets = (lm.local_batch(t) for t in data(cfg, step))
        with loss_context(model):  # loss_parallel: its backward too
            loss = llama_loss(model, model(tokens), targets)
            loss.backward()
        if step == 0:
            check_grads(what, model, cached_reference(cfg, lm.dp_size)[1])
        opt.step()
        opt.zero_grad()
        losses.append(lm.mean_over_dp(loss).item())
    expect_losses, _, expect = cached_reference(cfg, lm.dp_size)
    check_losses(what, losses, expect_losses)
    check_params(what, dict(model.named_parameters()), expect)


def run_pipeline(cfg: LlamaConfig, mesh, what: str, *, schedule: str, microbatches: int, ep: int = 1, **options):
    """STEPS steps through pipeline_llama equal the one-process reference with Dp x M chunks;
    returns the pipeline."""
    from moe.parallel import LlamaMesh, pipeline_llama

    lm = mesh if isinstance(mesh, LlamaMesh) else LlamaMesh.build(mesh, ep=ep)
    pipe = pipeline_llama(build(cfg), lm, schedule=schedule, microbatches=microbatches, **options)
    opt = optimizer(pipe.parameters())
    chunks = lm.dp_size * microbatches
    losses = []
    for step in range(STEPS):
        tokens, targets = (lm.local_batch(t) for t in data(cfg, step))
        losses.append(pipe.step(tokens, targets).item())
        if step == 0:
            for model in pipe.models:
                check_grads(what, model, cached_reference(cfg, chunks)[1])
        opt.step()
        opt.zero_grad()
    expect_losses, _, expect = cached_reference(cfg, chunks)
    check_losses(what, losses, expect_losses)
    mine = dict(pipe.named_parameters())
    check_params(what, mine, {n: expect[n] for n in map(strip, mine)}, complete=False)
    return pipe
