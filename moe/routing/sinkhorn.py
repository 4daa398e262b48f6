"""Sinkhorn routing (S-BASE; Megatron-core's "sinkhorn" load-balancing type).

Legend: T tokens, D model dim, E experts, K expert slots per token.

Training routes by the top-k of an approximately balanced transport plan between tokens and
experts, computed by a fixed number of Sinkhorn iterations; the gates stay the router's own scores.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import GatedRouter, bincount, check_seq_len, router_losses
from .result import RoutingResult, routing_stats

__all__ = ["SinkhornRouter", "sinkhorn"]


def sinkhorn(logits_TE: Tensor, iters: int, temperature: float = 1.0) -> Tensor:
    """Log of the entropic transport plan between T tokens and E experts: (T, E) fp32.

    Args:
        logits_TE: (T, E) finite scores; higher means a better match.
        iters: number of Sinkhorn iterations, fixed (no convergence test, so no host sync).
        temperature: the plan is ``diag(a) exp(logits / temperature) diag(b)``; lower is closer
            to a hard assignment and slower to converge.

    Normalisation: every row (token) of ``exp(plan)`` sums to 1 and every column (expert) to
    ``T / E``, so the total mass T is spread evenly over the experts. Each iteration fits the
    columns, then the rows: after any number of iterations the rows sum to 1 exactly and the
    columns approach ``T / E``. Everything is done in the log domain with logsumexp, so logits
    of magnitude 1e4 in fp32 give a finite plan where ``exp(logits)`` would overflow.
    """
    if not isinstance(logits_TE, Tensor) or logits_TE.dim() != 2 or not logits_TE.is_floating_point():
        got = (
            f"shape {tuple(logits_TE.shape)} dtype {logits_TE.dtype}"
            if isinstance(logits_TE, Tensor)
            else "a non-tensor"
        )
        raise ValueError(f"logits_TE must be a floating (T, E) tensor, got {got}")
    if not isinstance(iters, int) or isinstance(iters, bool) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    num_tokens, num_experts = logits_TE.shape
    log_k_TE = logits_TE.float() / temperature
    if num_tokens == 0 or num_experts == 0:
        return log_k_TE
    log_col = math.log(num_tokens / num_experts)
    u_T1 = log_k_TE.new_zeros(num_tokens, 1)
    v_1E = log_k_TE.new_zeros(1, num_experts)
    for _ in range(iters):
        v_1E = log_col - torch.logsumexp(log_k_TE + u_T1, dim=0, keepdim=True)
        u_T1 = -torch.logsumexp(log_k_TE + v_1E, dim=1, keepdim=True)
    return log_k_TE + u_T1 + v_1E


class SinkhornRouter(GatedRouter):
    """Token-choice router that balances by Sinkhorn in training (S-BASE, Megatron "sinkhorn").

    - Training: the chosen experts are the top-k of ``sinkhorn(logits, sinkhorn_iters,
      sinkhorn_temperature)``, computed without grad. The gates are the router's own scores at
      those experts, as in Megatron-core: ``sigmoid(logits)`` when K = 1 and ``softmax(logits)``
      when K > 1. They are not renormalised (``config.renormalize`` and ``config.score_func``
      are not read).
    - Eval: plain top-k of the logits, with the same gate function.
    - Balance is approximate: the plan's columns are only near ``T / E`` after a finite number
      of iterations, and the top-k of a balanced fractional plan need not be balanced. It is
      dropless: ``capacity_factor`` is not read.
    - Losses are zero unless their coefficients are set; the Switch loss uses the softmax of
      the logits and the selection, the z-loss the logits.

    Returned weights are fp32 whatever the input dtype.
    """

    def forward(self, x_TD: Tensor, *, seq_len: int | None = None) -> RoutingResult:
        """Route ``x: (T, D)``; ``seq_len`` splits the T tokens into sequences for the sequence-wise loss.

        Returns a `RoutingResult` with ``expert_idx, weights: (T, K)`` and ``counts: (E,)``.
        """
        cfg = self.config
        logits_TE = self.logits(x_TD)  # checks x
        num_tokens, k, num_experts = x_TD.shape[0], cfg.top_k, cfg.num_experts
        check_seq_len(cfg, seq_len, num_tokens)

        scores_TE = logits_TE.sigmoid() if k == 1 else logits_TE.softmax(dim=-1)
        if self.training:
            with torch.no_grad():
                plan_TE = sinkhorn(logits_TE.detach(), cfg.sinkhorn_iters, cfg.sinkhorn_temperature)
                idx_TK = plan_TE.topk(k, dim=-1).indices
        else:
            idx_TK = logits_TE.detach().topk(k, dim=-1).indices
        gates_TK = scores_TE.gather(1, idx_TK)

        probs_TE = logits_TE.softmax(dim=-1)
        aux_loss, z_loss = router_losses(cfg, logits_TE, probs_TE, idx_TK, seq_len)
        counts_E = bincount(idx_TK, num_experts)  # no output size read back (torch.compile)
        stats = None if torch.compiler.is_compiling() else routing_stats(counts_E, num_tokens * k, 0, probs_TE)
        return RoutingResult(
            expert_idx=idx_TK, weights=gates_TK, counts=counts_E, aux_loss=aux_loss, z_loss=z_loss, stats=stats
        )
