"""all_to_all over gloo with 2 and 3 processes: uneven and empty splits, gradients, dtypes."""

import pytest
import torch
import torch.distributed as dist

from moe.parallel import all_to_all

from .launch import init, spawn

pytestmark = pytest.mark.distributed

# SENDS[r][j]: rows rank r sends to rank j (a rank that sends nothing, a pair that exchanges nothing)
SENDS = {2: [[2, 3], [0, 1]], 3: [[1, 0, 2], [3, 1, 0], [0, 2, 2]]}


def rows_from(r: int, j: int, world: int, dtype) -> torch.Tensor:
    """The rows rank r sends to rank j: distinct values per (r, j, row)."""
    start = sum(SENDS[world][r][:j])
    n = SENDS[world][r][j]
    return (100 * r + torch.arange(start, start + n)).to(dtype)[:, None].repeat(1, 3)


def worker(rank: int, world: int, store: str) -> None:
    init(rank, world, store)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            check(rank, world, dtype)
    finally:
        dist.destroy_process_group()


def check(rank: int, world: int, dtype) -> None:
    ins = SENDS[world][rank]
    outs = [SENDS[world][j][rank] for j in range(world)]  # the transpose of the send matrix
    x = torch.cat([rows_from(rank, j, world, dtype) for j in range(world)])
    if dtype.is_floating_point:
        x.requires_grad_()
    y = all_to_all(x, outs, ins)
    expect = torch.cat([rows_from(j, rank, world, dtype) for j in range(world)])
    assert torch.equal(y.detach(), expect), (rank, y, expect)
    if dtype.is_floating_point:
        # each received row is scaled by (receiver + 1); a sent row's gradient says who got it
        (y.float() * (rank + 1)).sum().backward()
        dest = torch.cat([torch.full((n, 3), j + 1.0) for j, n in enumerate(ins)])
        assert torch.equal(x.grad.float(), dest)
    with pytest.raises(ValueError, match="input_splits"):
        all_to_all(x.detach(), outs, [*ins[:-1], ins[-1] + 1])  # checked locally: no hang


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_uneven_splits_gradients_and_dtypes(world):
    # fp32, bf16 and int64 in one process group per world size (each spawn costs seconds)
    spawn(worker, world)
