"""Exact-balance expert assignment (BASE layers) as a transportation problem.

Legend: T tokens, E experts, K experts per token, M (token, expert) pairs kept near a boundary.

Every token gets K distinct experts and every expert b = T*K // E tokens or one more, exactly
r = T*K % E of them one more: with ``extras="best"`` (the default) whichever r give the best
total, with ``"lowest"`` experts 0 .. r-1 (``expert_capacities(T, E, K)``). Among such
assignments we maximise the total score.

The optimum is described by E dual prices p: token t takes the K experts with the largest
``s[t, e] - p[e]``. The solver estimates those prices, lets every token pick under them,
completes the assignment greedily, and then improves and certifies it with exchange cycles
between experts (`moe.routing.exchange`). docs/routing.md gives the math.

The files, in the order a solve uses them: `inputs` (checks, normalisation), `buffers` (the
work buffers), `prices` and `pairs` (the dual prices), `pick` (the pick and the greedy fill),
then `exact`, `approx` and `reference`, one solver each; `capacities` holds the balance rule,
and `small` the exact solver's numpy path for small CPU problems at K = 1.
"""

# ruff: noqa: F401
# Besides the public names, the private helpers keep the paths they had when this was one module
# (the tests reach them as moe.routing.balanced._Pairs and the like).
from .approx import _APPROX_WIDTHS, _bids, _complete, balanced_assignment_approx
from .buffers import _WORKSPACE_MAX_BYTES, _buffers, _levels, _Work, _workspace, release_work_buffers
from .capacities import (
    EXTRAS,
    _Capacities,
    _check_extras,
    _loads,
    _round_robin,
    assignment_bound,
    assignment_score,
    expert_capacities,
    expert_capacities_list,
)
from .exact import balanced_assignment, balanced_prices
from .inputs import (
    _add_jitter,
    _check,
    _check_finite,
    _check_options,
    _jitter_pattern,
    _normalise,
    _normalise_nosync,
    _nothing_to_solve,
    _sub_transposed,
)
from .pairs import _above, _keep_best, _keep_best_device, _keep_best_host, _pair_layout, _pair_layout_host, _Pairs
from .pick import _fill, _select, _swap_in, _top_values
from .prices import _BINS_DENSE, _jacobi_prices, _margins, _merge_row, _prices, _row_quantiles, _top2
from .reference import balanced_assignment_ref

__all__ = [
    "balanced_assignment",
    "balanced_assignment_approx",
    "balanced_prices",
    "balanced_assignment_ref",
    "expert_capacities",
    "expert_capacities_list",
    "assignment_bound",
    "assignment_score",
    "release_work_buffers",
]
