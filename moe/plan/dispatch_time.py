"""Time of one MoE layer's expert-parallel exchange for one micro-batch (docs/scale.md, "Time"):
the bytes each dispatcher sends within and between nodes, and what the chunked overlap hides.

Legend: T tokens of the micro-batch on one rank, K experts per token, E experts, D model dim,
a bytes per activation element, W ep ranks, L ep ranks per node (the ep peers are tp ranks
apart), N = W / L nodes the ep group spans, C chunks.

- flat (`moe.parallel.flat`): every (token, expert) row goes to its expert's rank: of K T rows,
  (L - 1) / W stay in the node (NVLink), (W - L) / W cross between nodes; both at once, the
  slower sets the time.
- hierarchical (`moe.parallel.hierarchical`): stage 1 sends a token once to each destination
  node other than its own, stage 2 fans the rows out inside the node; the two stages run one
  after the other. Under uniform routing a token's K distinct experts reach
  N (1 - C(E - E/N, K) / C(E, K)) nodes on average; with group-limited routing whose groups are
  whole nodes (router ``n_groups`` a multiple of N, ``topk_groups`` = M) at most M. Of those,
  a fraction (N - 1) / N is another node. The combine sends one sum per (token, node) back:
  the same bytes.
- chunks (C > 1): chunk i + 1's dispatch runs while chunk i's experts compute and chunk i's
  combine while chunk i + 1's experts do, so of an exchange of time A beside expert GEMMs of
  time G, min(A, G) (C - 1) / C is hidden: the first dispatch and the last combine never are.
  Forward and backward alike (the backward's expert GEMMs take twice the forward's).
- latency: every all-to-all also costs a fixed time, `A2A_LATENCY_S` inside a node and across
  nodes (assumed: small-message NCCL all-to-all times of that order; not measured here). A
  dispatch (or combine) makes C of them, 2 C under the two-level dispatch (a stage between
  nodes and one inside each); the latencies count with the bandwidth time in what the overlap
  can hide. Each forward's count exchange (and the two-level one's expert-id exchange) is on
  the critical path: `fixed_latency_s`. So at small expert GEMMs more chunks cost more.
"""

from __future__ import annotations

from math import comb

from ..models.llama import LlamaConfig
from .layout import Layout

__all__ = [
    "A2A_LATENCY_S",
    "chunk_latency_s",
    "ep_layer",
    "ep_ranks_per_node",
    "exchange_s",
    "expected_nodes",
    "exposed",
    "fixed_latency_s",
    "node_limit",
]

A2A_LATENCY_S = {"nvlink": 15e-6, "net": 50e-6}  # one all-to-all's fixed cost, inside a node / across nodes


def node_limit(cfg: LlamaConfig, nodes: int) -> int | None:
    """M when the router is group-limited with groups lying in whole nodes, else None."""
    opts = cfg.moe.router_options or {}
    groups, keep = opts.get("n_groups"), opts.get("topk_groups")
    if not groups or not keep or groups % nodes:
        return None
    return keep


def expected_nodes(experts: int, k: int, nodes: int, limit: int | None = None) -> float:
    """Distinct nodes a token's K experts sit on, in expectation, under uniform routing
    (experts in N equal contiguous blocks), capped at the node limit M."""
    per = experts // nodes
    miss = comb(experts - per, k) / comb(experts, k) if experts - per >= k else 0.0
    n = nodes * (1 - miss)
    return min(n, limit) if limit else n


def ep_ranks_per_node(lay: Layout, gpn: int) -> int:
    """L: the ep ranks in one node of ``gpn`` GPUs (the ep peers are tp ranks apart), at most W."""
    return min(lay.ep, max(1, gpn // lay.tp))


def ep_layer(cfg: LlamaConfig, lay: Layout, tokens: int, rows: int, act_bytes: int, gpn: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends in one dispatch (= one combine) of a layer."""
    W = lay.ep
    L = ep_ranks_per_node(lay, gpn)  # ep peers in my node
    N = W // L
    row = cfg.dim * act_bytes
    if lay.dispatch == "flat" or N == 1:
        return rows * (L - 1) / W * row, rows * (W - L) / W * row
    pairs = tokens * expected_nodes(cfg.moe.num_experts, cfg.moe.top_k, N, node_limit(cfg, N)) * (N - 1) / N
    return rows * (L - 1) / L * row, pairs * row


def exchange_s(lay: Layout, intra: float, inter: float, nvlink_bw: float, net_bw: float) -> float:
    """Seconds of one dispatch (or combine): concurrent under flat, two stages under hierarchical."""
    t_in, t_out = intra / nvlink_bw, inter / net_bw
    return t_in + t_out if lay.dispatch == "hierarchical" else max(t_in, t_out)


def chunk_latency_s(lay: Layout, nodes: int) -> float:
    """The fixed cost of one dispatch's (or combine's) all-to-alls: C of them, over the network
    when the ep group spans nodes; under the two-level dispatch a stage between nodes and one
    inside the node per chunk."""
    if nodes == 1:
        return lay.chunks * A2A_LATENCY_S["nvlink"]
    if lay.dispatch == "hierarchical":
        return lay.chunks * (A2A_LATENCY_S["net"] + A2A_LATENCY_S["nvlink"])
    return lay.chunks * A2A_LATENCY_S["net"]


def fixed_latency_s(lay: Layout, nodes: int) -> float:
    """Each forward's exchanges no overlap hides: the count exchange over the ep group, and the
    two-level dispatcher's expert ids between nodes."""
    hop = A2A_LATENCY_S["net" if nodes > 1 else "nvlink"]
    return hop * (2 if lay.dispatch == "hierarchical" and nodes > 1 else 1)


def exposed(comm_s: float, experts_s: float, chunks: int) -> float:
    """What the chunked overlap leaves on the critical path of an exchange of ``comm_s`` beside
    expert GEMMs of ``experts_s``."""
    return comm_s - min(comm_s, experts_s) * (chunks - 1) / chunks
