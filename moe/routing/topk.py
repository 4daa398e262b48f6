"""Top-k token-choice router (Switch, Mixtral, DeepSeek-V3).

Legend: T tokens, D model dim, E experts, K expert slots per token, G expert groups, N = T*K slots.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import GatedRouter, bincount, check_seq_len, drop_by_score, in_backward, router_losses
from .config import RouterConfig
from .result import RoutingResult, routing_stats

__all__ = ["TopKRouter"]

_TINY = torch.finfo(torch.float32).tiny  # keeps a renormalising division finite when every score underflowed


class TopKRouter(GatedRouter):
    """Each token picks its K best experts by score (token choice).

    - Scores: ``softmax`` or ``sigmoid`` of the fp32 logits ``x @ weight.T`` (``config.score_func``).
    - Selection: top-k of ``scores + bias``. ``bias`` (E,) is a buffer for aux-loss-free balancing
      (DeepSeek-V3): it changes which experts are chosen, never the gate values. In training with
      ``config.bias_update_rate > 0`` every forward moves it, outside autograd, by
      ``rate * sign(mean_load - load_e)``, where loads count the selection before capacity drops.
      ``sum_over_ranks`` (set by ``moe.parallel.parallelize_moe``) sums the loads over the ranks
      that share this router, so the bias stays the same on all of them. A forward re-run by
      activation checkpointing selects with the bias its first run used and moves nothing.
    - Group-limited routing (``n_groups > 1``): experts form ``n_groups`` contiguous groups; a
      group's score is the sum of its two best (biased) scores, one when a group has a single
      expert; each token may only choose experts of its ``topk_groups`` best groups.
    - Gates: the chosen (unbiased) scores, divided by their sum when ``config.renormalize``.
    - Capacity: ``capacity_factor=None`` is dropless. Otherwise every expert takes at most
      ``ceil(capacity_factor * T * K / E)`` slots. Drop policy "by score": an over-full expert
      keeps its slots with the highest gate value (after renormalisation), ties going to the
      lowest token index, and drops the rest (``expert_idx = -1``, ``weight = 0``). A dropped
      slot is not re-routed; the token's other slots keep their weights.
    - Losses: ``aux_loss = aux_loss_coef * load_balancing_loss + seq_aux_loss_coef *
      sequence_load_balancing_loss`` (the latter needs ``seq_len``) and ``z_loss = z_loss_coef *
      router_z_loss``. They use the selection before capacity drops, as Switch and Megatron do,
      so dropping never lowers the loss, and probabilities that sum to one per token: the softmax,
      or the sigmoid scores divided by their sum.

    Returned weights are fp32 whatever the input dtype.
    """

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.register_buffer("bias", torch.zeros(config.num_experts))  # (E,) selection-only bias
        self.sum_over_ranks = None  # Tensor -> Tensor summed over the ranks sharing this router
        self._forward_bias = None  # the bias the last forward selected with (for a recompute)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "bias", None) is not None:  # registered after the first call, in __init__
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x_TD: Tensor, *, seq_len: int | None = None) -> RoutingResult:
        """Route ``x: (T, D)``; ``seq_len`` splits the T tokens into sequences for the sequence-wise loss.

        Returns a `RoutingResult` with ``expert_idx, weights: (T, K)`` and ``counts: (E,)``.
        """
        cfg = self.config
        logits_TE = self.logits(x_TD)  # checks x
        num_tokens, k, num_experts = x_TD.shape[0], cfg.top_k, cfg.num_experts
        check_seq_len(cfg, seq_len, num_tokens)

        scores_TE = logits_TE.softmax(dim=-1) if cfg.score_func == "softmax" else logits_TE.sigmoid()
        recompute = in_backward()  # activation checkpointing: select as the first forward did
        bias = self._forward_bias if recompute and self._forward_bias is not None else self.bias
        idx_TK = self._select(scores_TE.detach(), bias)
        gates_TK = scores_TE.gather(1, idx_TK)
        if cfg.renormalize:
            gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True).clamp(min=_TINY)
        if self.training and cfg.bias_update_rate > 0 and not recompute:
            self._forward_bias = self.bias.clone()
            self._update_bias(idx_TK)

        if cfg.score_func == "softmax":
            probs_TE = scores_TE
        else:
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp(min=_TINY)
        aux_loss, z_loss = router_losses(cfg, logits_TE, probs_TE, idx_TK, seq_len)

        if cfg.capacity_factor is not None:
            capacity = math.ceil(cfg.capacity_factor * num_tokens * k / num_experts)
            keep_TK = drop_by_score(idx_TK, gates_TK.detach(), num_experts, capacity)
            idx_TK = torch.where(keep_TK, idx_TK, -1)
            gates_TK = torch.where(keep_TK, gates_TK, torch.zeros_like(gates_TK))
            # no boolean-mask select: its data-dependent size would break a torch.compile graph
            valid_N = keep_TK.reshape(-1).long()
            counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_TK.device)
            counts_E = counts_E.index_add_(0, idx_TK.reshape(-1).clamp(min=0), valid_N)
        else:
            counts_E = bincount(idx_TK, num_experts)
        stats = None  # plain floats need host reads, which a compiled graph cannot make
        if not torch.compiler.is_compiling():
            stats = routing_stats(counts_E, num_tokens * k, None, probs_TE)
        return RoutingResult(
            expert_idx=idx_TK, weights=gates_TK, counts=counts_E, aux_loss=aux_loss, z_loss=z_loss, stats=stats
        )

    def _select(self, scores_TE: Tensor, bias_E: Tensor) -> Tensor:
        """(T, E) scores without grad -> (T, K) chosen experts, honouring the bias and group limits."""
        cfg = self.config
        sel_TE = scores_TE + bias_E.float()
        groups = cfg.n_groups
        if groups > 1 and cfg.topk_groups < groups:
            num_tokens, num_experts = sel_TE.shape
            per_group = num_experts // groups
            sel_TGX = sel_TE.view(num_tokens, groups, per_group)
            group_TG = sel_TGX.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
            best_TG = group_TG.topk(cfg.topk_groups, dim=-1).indices
            allowed_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_TG, True)
            sel_TE = sel_TE.masked_fill(~allowed_TG.repeat_interleave(per_group, dim=1), float("-inf"))
        return sel_TE.topk(cfg.top_k, dim=-1).indices

    @torch.no_grad()
    def _update_bias(self, idx_TK: Tensor) -> None:
        num_experts = self.config.num_experts
        load_E = torch.bincount(idx_TK.reshape(-1), minlength=num_experts).float()
        if self.sum_over_ranks is not None:
            load_E = self.sum_over_ranks(torch.cat([load_E, load_E.new_tensor([idx_TK.numel()])]))
            load_E, slots = load_E[:-1], load_E[-1]
        else:
            slots = idx_TK.numel()
        mean_load = slots / num_experts
        self.bias.add_(self.config.bias_update_rate * torch.sign(mean_load - load_E).to(self.bias.dtype))
