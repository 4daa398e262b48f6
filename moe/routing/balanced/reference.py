"""`balanced_assignment_ref`: the slow, exact reference solver the tests compare to."""

from __future__ import annotations

import torch
from torch import Tensor

from ..exchange import cancel_cycles
from .capacities import _check_extras, _round_robin
from .inputs import _check, _check_options, _normalise


def balanced_assignment_ref(scores_TE: Tensor, k: int = 1, *, eps: float = 1e-9, extras: str = "best") -> Tensor:
    """Reference solver: a round-robin balanced start, then exchange cycles over all tokens
    until none gains more than ``eps`` (relative to the largest per-token score range) per move.
    ``extras`` as in `balanced_assignment` (under ``"best"`` the cycles may also move the extra
    slots, through the holder of the unused ones: `moe.routing.exchange`).

    Exactly optimal up to that resolution; slow (one search per step), for tests and small
    inputs. Raises RuntimeError if it has not converged after 10 * T * K + 100 cycles.
    """
    _check_extras(extras)
    _check(scores_TE, k)
    _check_options(0, None, eps)
    num_tokens, num_experts = scores_TE.shape
    out = _round_robin(num_tokens, num_experts, k, scores_TE.device)
    if num_tokens == 0:
        return out
    with torch.no_grad():
        s = _normalise(scores_TE.double(), jitter=0.0)  # the round robin is balanced by the same rule
        delta = max(eps, 8 * torch.finfo(s.dtype).eps)
        cycles = 10 * num_tokens * k + 100
        if not cancel_cycles(s, out, max_cycles=cycles, delta=delta, movable=extras == "best"):
            raise RuntimeError("balanced_assignment_ref did not converge")
    return out
