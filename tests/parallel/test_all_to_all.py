"""all_to_all over gloo with 2 and 3 processes: uneven and empty splits, gradients, dtypes."""

import pytest
import torch
import torch.distributed as dist

from moe.parallel import all_gather_rows, all_to_all, reduce_scatter_rows

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
        check_gather_and_reduce_scatter(rank, world)
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


def check_gather_and_reduce_scatter(rank: int, world: int) -> None:
    """Uneven row counts (rank 1 has none): all_gather_rows stacks every rank's rows and its
    backward sums the ranks' gradients for this rank's rows; reduce_scatter_rows sums this
    rank's block over the ranks and its backward hands every rank the gradient of the block."""
    sizes = [r + 1 if r != 1 else 0 for r in range(world)]
    rows = [torch.arange(sizes[r] * 2, dtype=torch.float64).view(-1, 2) + 100 * r for r in range(world)]
    x = rows[rank].clone().requires_grad_()
    y = all_gather_rows(x, sizes)
    assert torch.equal(y.detach(), torch.cat(rows))
    (y * (rank + 1)).sum().backward()  # every rank weighs what it received by (rank + 1)
    assert torch.equal(x.grad, torch.full_like(x, sum(range(1, world + 1))))

    total = sum(sizes)
    z = (torch.arange(total * 2, dtype=torch.float64).view(total, 2) * (rank + 1)).requires_grad_()
    mine = reduce_scatter_rows(z, sizes)
    start = sum(sizes[:rank])
    expect = torch.arange(total * 2, dtype=torch.float64).view(total, 2)[start : start + sizes[rank]]
    assert torch.equal(mine.detach(), expect * sum(range(1, world + 1)))
    (mine * (rank + 1)).sum().backward()  # rank j's block is weighed by (j + 1)
    weights = torch.cat([torch.full((n, 2), j + 1.0, dtype=torch.float64) for j, n in enumerate(sizes)])
    assert torch.equal(z.grad, weights)
    wrong = [n + (r == rank) for r, n in enumerate(sizes)]  # this rank's own count is off: checked locally
    with pytest.raises(ValueError, match="sizes"):
        all_gather_rows(x.detach(), wrong)
