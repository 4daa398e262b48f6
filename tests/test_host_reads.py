"""The host-read tracker the sync-free tests rely on sees the reads it claims to, and only those."""

import torch

from moe.kernels import grouped_mm

from .host_reads import HostReads


def test_records_reads_of_derived_values_only():
    x = torch.randn(6)
    made_here = torch.tensor([1, 2, 3])
    with HostReads(x) as seen:
        made_here.tolist(), int(made_here.sum()), bool(made_here[0] > 0)  # not derived from x
        y = (x * 2)[1:]  # a view of a result
        assert seen.reads == []
        buf = torch.zeros(5)
        buf.copy_(y)  # an in-place write carries the taint
        buf.tolist()
        float(y.sum())
        bool(y[0] > 0)
        torch.nonzero(y)
        torch.bincount((y > 0).long())
        y[y > 0]
        torch._assert_async(torch.isfinite(y).all())  # a device assert is not a read
        y.numpy()
    assert seen.reads == [
        "Tensor.tolist",
        "aten._local_scalar_dense.default",
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.bincount.default",
        "aten.index.Tensor",
        "Tensor.numpy",
    ]
    assert torch.Tensor.tolist(made_here) == [1, 2, 3]  # the patches are undone


def test_records_counts_read_inside_custom_ops_and_blocking_copies():
    x, w = torch.randn(10, 16), torch.randn(2, 16, 8)
    counts = torch.tensor([4, 6])
    with HostReads(x, counts) as seen:
        grouped_mm(x, w, counts)
    assert seen.reads == ["moe.grouped_mm.default"]
    with HostReads(x) as seen:
        grouped_mm(x, w, counts)  # host counts: nothing read
        torch.tensor([1.0], device=x.device)
    assert seen.reads == ["torch.tensor(device=...)"]
