"""BASE router (Lewis et al. 2021): balanced assignment in training, greedy top-k in eval.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .balanced import balanced_assignment, balanced_assignment_approx
from .common import GatedRouter, bincount, check_seq_len, router_losses
from .result import RoutingResult, routing_stats

__all__ = ["BaseRouter"]

_SOLVERS = (balanced_assignment, balanced_assignment_approx)


@torch.library.custom_op("moe::base_assign", mutates_args=())
def _base_assign(scores_TE: Tensor, k: int, max_iters: int, approx: bool, extras: str) -> Tensor:
    """The BASE training assignment as one op, so torch.compile keeps it whole:
    (T, E) scores -> (T, K) int64 experts; ``max_iters`` -1 takes the solver's default."""
    solver = balanced_assignment_approx if approx else balanced_assignment
    options = {"extras": extras} if max_iters < 0 else {"extras": extras, "max_iters": max_iters}
    return solver(scores_TE, k, **options)


@_base_assign.register_fake
def _(scores_TE: Tensor, k: int, max_iters: int, approx: bool, extras: str) -> Tensor:
    return scores_TE.new_empty((scores_TE.shape[0], k), dtype=torch.int64)


class BaseRouter(GatedRouter):
    """Routes by token-centroid affinity s = x @ centroids.T (fp32).

    Training: `balanced_assignment` on s, so every expert gets exactly its share of the tokens
    (`balanced_assignment_approx` with ``base_solver="approx"``: the same balance, no host sync);
    ``base_extras`` says which experts take the extra tokens when T * K % E > 0.
    Eval (``module.eval()``): each token takes its K highest-affinity experts, as in the paper.
    The gate is sigmoid(s) at the chosen experts: the assignment itself has no gradient, the
    centroids learn through the gate. With K = 1 the layer's ``sigmoid_residual`` combine gives
    BASE's ``alpha * expert(x) + (1 - alpha) * x``.
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        # the training assignment: (scores (T, E), k, extras=..., max_iters=...) -> (T, K); replaced by
        # moe.parallel.parallelize_moe(global_base=True) to balance over the expert-parallel group
        self.assign = balanced_assignment if config.base_solver == "exact" else balanced_assignment_approx

        # set by moe.parallel.parallelize_moe(static_splits=True), whose path then reads nothing
        # else back: see host_syncs
        self.sync_free = False

    @property
    def host_syncs(self) -> bool:
        """False while this router reads nothing back from the device: ``sync_free`` and
        training with the sync-free solver (``base_solver="approx"``). Its `RoutingResult` then
        has no stats (plain floats would need a read) and its input is checked with
        ``torch._assert_async`` (elsewhere a NaN raises ValueError, which the counted
        expert-parallel path passes on to the other ranks)."""
        return not (self.sync_free and self.training and self.assign is balanced_assignment_approx)

    def reset_parameters(self) -> None:
        # orthogonal centroids, small gain: distinct experts, gates start near sigmoid(0) = 0.5
        nn.init.orthogonal_(self.weight, gain=0.1)

    def forward(self, x_TD: Tensor, *, seq_len: int | None = None) -> RoutingResult:
        """Route ``x: (T, D)``. Returns ``expert_idx, weights: (T, K)``, ``counts: (E,)``.

        Losses follow the config's coefficients like the other routers (BASE itself needs none:
        its balance is exact by construction).
        """
        cfg = self.config
        logits_TE = self.logits(x_TD, host_check=self.host_syncs)  # (T, E) token-centroid affinities
        check_seq_len(cfg, seq_len, x_TD.shape[0])
        if self.training:
            options = {"extras": cfg.base_extras}
            if cfg.base_max_iters is not None:
                options["max_iters"] = cfg.base_max_iters
            if torch.compiler.is_compiling() and self.assign in _SOLVERS:
                # the solver runs numpy on the host: opaque to the tracer, a custom op with a fake
                approx = self.assign is balanced_assignment_approx
                max_iters = -1 if cfg.base_max_iters is None else cfg.base_max_iters
                idx_TK = torch.ops.moe.base_assign(logits_TE.detach(), cfg.top_k, max_iters, approx, cfg.base_extras)
            else:
                idx_TK = self.assign(logits_TE.detach(), cfg.top_k, **options)
        else:
            idx_TK = logits_TE.detach().topk(cfg.top_k, dim=1).indices
        preferred = None
        if self.training:  # slots on one of their token's K best experts: what balance costs
            best_TK = logits_TE.detach().topk(cfg.top_k, dim=1).indices
            preferred = (idx_TK.unsqueeze(2) == best_TK.unsqueeze(1)).any(dim=2).sum()
        weights_TK = torch.sigmoid(logits_TE.gather(1, idx_TK))
        counts_E = bincount(idx_TK, cfg.num_experts)
        probs_TE = logits_TE.softmax(dim=-1)
        aux_loss, z_loss = router_losses(cfg, logits_TE, probs_TE, idx_TK, seq_len)
        stats = None  # plain floats need host reads: none without them, nor in a compiled graph
        if self.host_syncs and not torch.compiler.is_compiling():
            stats = routing_stats(counts_E, idx_TK.numel(), 0, probs_TE)
        return RoutingResult(
            expert_idx=idx_TK, weights=weights_TK, counts=counts_E, aux_loss=aux_loss, z_loss=z_loss, stats=stats,
            preferred=preferred,
        )  # fmt: skip
