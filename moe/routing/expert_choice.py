"""Expert-choice router (Zhou et al. 2022): experts pick tokens instead of tokens picking experts.

Legend: T tokens, D model dim, E experts, K average experts per token, C tokens per expert.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import GatedRouter
from .losses import router_z_loss
from .result import RoutingResult, routing_stats

__all__ = ["ExpertChoiceRouter", "expert_choice_capacity"]


def expert_choice_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float | None) -> int:
    """C = ceil(capacity_factor * T * K / E), capacity_factor None meaning 1, at most T."""
    cf = 1.0 if capacity_factor is None else capacity_factor
    return min(num_tokens, math.ceil(cf * num_tokens * k / num_experts))


class ExpertChoiceRouter(GatedRouter):
    """Each expert takes its C best tokens; a token is taken by anywhere from 0 to E experts.

    - Scores: ``softmax`` over experts of the fp32 logits ``x @ weight.T``.
    - Selection: expert e takes the C tokens with the highest score in its column, with
      ``C = ceil(capacity_factor * T * K / E)`` (``capacity_factor=None`` counts as 1) and at
      most T, so every expert processes exactly C tokens: balanced by construction.
    - Result layout: ``expert_idx`` and ``weights`` are (T, E), one slot per expert.
      ``expert_idx[t, e] = e`` if expert e took token t, else -1; ``weights[t, e]`` is the
      softmax score there and 0 where the slot is empty. ``RoutingResult.top_k`` is therefore E.
    - Stats: ``dropped_fraction`` is the fraction of the T tokens taken by no expert.
    - Losses: ``aux_loss`` is always zero (there is nothing to balance; ``aux_loss_coef`` and
      ``seq_aux_loss_coef`` are not read); ``z_loss = z_loss_coef * router_z_loss(logits)``.

    Every expert looks at the whole batch, so in a causal language model a token's routing
    depends on later tokens; ``seq_len`` is accepted for a common router signature and ignored.
    Returned weights are fp32 whatever the input dtype.
    """

    def forward(self, x_TD: Tensor, *, seq_len: int | None = None) -> RoutingResult:
        """Route ``x: (T, D)``. Returns a `RoutingResult` with ``expert_idx, weights: (T, E)`` and ``counts: (E,)``."""
        cfg = self.config
        num_tokens, num_experts = x_TD.shape[0], cfg.num_experts
        capacity = expert_choice_capacity(num_tokens, num_experts, cfg.top_k, cfg.capacity_factor)

        logits_TE = self.logits(x_TD)
        probs_TE = logits_TE.softmax(dim=-1)
        token_EC = probs_TE.detach().T.topk(capacity, dim=-1).indices
        taken_ET = torch.zeros(num_experts, num_tokens, dtype=torch.bool, device=x_TD.device)
        taken_ET.scatter_(1, token_EC, True)
        taken_TE = taken_ET.T
        experts_E = torch.arange(num_experts, device=x_TD.device)
        idx_TE = torch.where(taken_TE, experts_E, -1)
        weights_TE = torch.where(taken_TE, probs_TE, torch.zeros_like(probs_TE))

        aux_loss = logits_TE.new_zeros(())
        z_loss = logits_TE.new_zeros(())
        if cfg.z_loss_coef > 0:
            z_loss = z_loss + cfg.z_loss_coef * router_z_loss(logits_TE)
        counts_E = taken_ET.sum(dim=1)
        stats = None  # plain floats need host reads, which a compiled graph cannot make
        if not torch.compiler.is_compiling():
            stats = routing_stats(counts_E, num_tokens, (~taken_TE.any(dim=1)).sum(), probs_TE)
        return RoutingResult(
            expert_idx=idx_TE, weights=weights_TE, counts=counts_E, aux_loss=aux_loss, z_loss=z_loss, stats=stats
        )
