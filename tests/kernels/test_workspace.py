"""The kept CPU memory of `moe.kernels.workspace`: reused only when nothing else holds it."""

import os
import threading

import pytest
import torch

from moe.kernels import workspace

CPU = torch.device("cpu")
BIG = (512, 1024)  # 2 MiB of fp32: kept


@pytest.fixture(autouse=True)
def fresh_workspace():
    limit = workspace._limit[0]  # as tests/conftest.py set it
    workspace.release()
    yield
    workspace.set_limit(limit)
    workspace.release()


GIB = 1 << 30


def test_the_default_limit_is_a_quarter_of_the_memory_over_torchruns_local_processes_and_at_least_2_gib():
    limit = workspace._default_limit
    assert limit(64 * GIB, {}) == 16 * GIB
    assert limit(64 * GIB, {"LOCAL_WORLD_SIZE": "4"}) == 4 * GIB
    assert limit(64 * GIB, {"LOCAL_WORLD_SIZE": " 2"}) == 8 * GIB
    assert limit(4 * GIB, {}) == limit(None, {}) == limit(64 * GIB, {"LOCAL_WORLD_SIZE": "64"}) == 2 * GIB
    for bad in ("0", "-2", "x", "", "\u00b2", "1.5"):  # not a launcher's count: as one process
        assert limit(64 * GIB, {"LOCAL_WORLD_SIZE": bad}) == 16 * GIB


def test_the_memory_is_the_machines_or_its_containers_where_lower(tmp_path, monkeypatch):
    if not hasattr(os, "sysconf"):
        pytest.skip("reads the machine's memory through os.sysconf")
    none, low, high, unlimited = (tmp_path / name for name in ("none", "low", "high", "unlimited"))
    low.write_text(f"{GIB}\n")
    high.write_text(f"{1 << 60}\n")
    unlimited.write_text("max\n")
    monkeypatch.setattr(workspace, "_CGROUP_LIMITS", (str(none), str(unlimited)))
    machine = workspace._memory_bytes()
    assert machine == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > GIB
    monkeypatch.setattr(workspace, "_CGROUP_LIMITS", (str(high), str(low)))
    assert workspace._memory_bytes() == GIB
    monkeypatch.setattr(workspace, "_CGROUP_LIMITS", (str(high), str(none)))
    assert workspace._memory_bytes() == machine
    odd = tmp_path / "odd"
    odd.write_bytes(b"\xff\xfe")
    monkeypatch.setattr(workspace, "_CGROUP_LIMITS", (str(odd), str(tmp_path), str(low)))  # bytes, a directory
    assert workspace._memory_bytes() == GIB
    monkeypatch.undo()
    assert workspace.DEFAULT_LIMIT == workspace._default_limit(workspace._memory_bytes(), os.environ)


def test_unused_block_is_reused_and_shaped_as_asked():
    a = workspace.empty(BIG, torch.float32, CPU)
    ptr = a.data_ptr()
    del a
    b = workspace.empty((300, 1024), torch.float32, CPU)  # smaller, but over half the block
    assert b.data_ptr() == ptr and b.shape == (300, 1024) and b.is_contiguous()
    del b
    c = workspace.empty((512, 2048), torch.bfloat16, CPU)  # the same bytes as another dtype
    assert c.data_ptr() == ptr and c.dtype == torch.bfloat16
    assert workspace.kept_bytes() == 2 << 20


def test_block_in_use_is_not_handed_out():
    a = workspace.empty(BIG, torch.float32, CPU)
    ptr = a.data_ptr()
    view = a[1:]  # a view still holds the storage
    del a
    assert workspace.empty(BIG, torch.float32, CPU).data_ptr() != ptr
    del view
    assert workspace.empty(BIG, torch.float32, CPU).data_ptr() == ptr


def test_block_saved_for_backward_stays_until_the_graph_goes():
    w = torch.randn(BIG, requires_grad=True)
    a = workspace.empty(BIG, torch.float32, CPU).fill_(2.0)
    ptr = a.data_ptr()
    loss = (a * w).sum()  # autograd saves a for w's gradient
    del a
    b = workspace.empty(BIG, torch.float32, CPU).fill_(-1.0)  # must not overwrite the saved a
    assert b.data_ptr() != ptr
    loss.backward()
    assert bool((w.grad == 2.0).all())
    del loss, b
    assert workspace.empty(BIG, torch.float32, CPU).data_ptr() == ptr  # the first of two equal blocks


def test_too_large_or_too_small_blocks_are_not_used():
    a = workspace.empty(BIG, torch.float32, CPU)
    ptr = a.data_ptr()
    del a
    assert workspace.empty((200, 1024), torch.float32, CPU).data_ptr() != ptr  # under half: its own block
    assert workspace.empty((1024, 1024), torch.float32, CPU).data_ptr() != ptr  # over: a new block


def test_small_tensors_and_other_devices_are_plain_allocations():
    small = workspace.empty((16, 16), torch.float32, CPU)
    meta = workspace.empty(BIG, torch.float32, torch.device("meta"))
    assert small.shape == (16, 16) and meta.device.type == "meta" and meta.shape == BIG
    assert workspace.kept_bytes() == 0


def test_limit_and_release():
    workspace.set_limit(3 << 20)
    a = workspace.empty(BIG, torch.float32, CPU)  # 2 MiB kept
    b = workspace.empty(BIG, torch.float32, CPU)  # would exceed 3 MiB while a is in use: not kept
    assert workspace.kept_bytes() == 2 << 20
    del a, b
    c = workspace.empty((1024, 1024), torch.float32, CPU)  # 4 MiB: over the limit even alone
    assert workspace.kept_bytes() == 0  # the unused 2 MiB block was dropped to try to make room
    workspace.set_limit(8 << 20)
    d = workspace.empty(BIG, torch.float32, CPU)
    assert workspace.kept_bytes() == 2 << 20
    workspace.set_limit(0)  # unused blocks beyond the limit go now; the one in use stays
    assert workspace.kept_bytes() == 2 << 20
    del d
    workspace.set_limit(0)
    assert workspace.kept_bytes() == 0
    workspace.set_limit(8 << 20)
    e = workspace.empty(BIG, torch.float32, CPU)
    workspace.release()
    assert workspace.kept_bytes() == 0 and e.shape == BIG and c.shape == (1024, 1024)
    with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
        workspace.set_limit(-1)


def test_threads_keep_their_own_blocks():
    a = workspace.empty(BIG, torch.float32, CPU)
    ptr = a.data_ptr()
    del a
    seen = []

    def other():
        seen.append((workspace.kept_bytes(), workspace.empty(BIG, torch.float32, CPU).data_ptr()))
        workspace.release()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen[0][0] == 0 and seen[0][1] != ptr and workspace.kept_bytes() == 2 << 20
    assert workspace.empty(BIG, torch.float32, CPU).data_ptr() == ptr


def test_a_held_storage_object_keeps_its_block():
    a = workspace.empty(BIG, torch.float32, CPU).fill_(1.0)
    ptr, storage = a.data_ptr(), a.untyped_storage()
    del a
    b = workspace.empty(BIG, torch.float32, CPU).fill_(-5.0)
    assert b.data_ptr() != ptr and bool((torch.empty(0).set_(storage) == 1.0).all())
    del b, storage
    assert workspace.empty(BIG, torch.float32, CPU).data_ptr() == ptr


def test_a_block_moved_to_shared_memory_is_forgotten():
    a = workspace.empty(BIG, torch.float32, CPU)
    a.share_memory_()  # as sending it to another process does: that process may still read it
    ptr = a.data_ptr()
    del a
    assert workspace.empty(BIG, torch.float32, CPU).data_ptr() != ptr
    assert workspace.kept_bytes() == 2 << 20  # only the new block


def test_limit_zero_stops_keeping_blocks_in_use_once_freed():
    a = workspace.empty(BIG, torch.float32, CPU)
    workspace.set_limit(0)
    assert workspace.kept_bytes() == 2 << 20  # in use: kept until freed
    del a
    b = workspace.empty(BIG, torch.float32, CPU)
    assert workspace.kept_bytes() == 0 and b.shape == BIG


def test_fake_tensors_leave_the_kept_blocks_alone():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = workspace.empty(BIG, torch.float32, CPU)
    ptr = real.data_ptr()
    del real
    with FakeTensorMode():
        fake = workspace.empty(BIG, torch.float32, CPU)
        assert fake.shape == BIG
    assert workspace.kept_bytes() == 2 << 20
    assert workspace.empty(BIG, torch.float32, CPU).data_ptr() == ptr


@pytest.mark.parametrize(
    "args, match",
    [
        (((4, -1), torch.float32, CPU), "shape must be"),
        ((3, torch.float32, CPU), "shape must be"),
        (((4, 4), "float32", CPU), "dtype must be"),
    ],
)
def test_bad_input_raises(args, match):
    with pytest.raises(ValueError, match=match):
        workspace.empty(*args)
    with pytest.raises(ValueError, match="nbytes"):
        workspace.set_limit(True)


def test_string_device_is_accepted():
    assert workspace.empty(BIG, torch.float32, "cpu").device == CPU


def test_a_block_resized_through_its_tensor_is_forgotten():
    a = workspace.empty(BIG, torch.float32, CPU)
    a.resize_(1024, 1024)  # grows the storage in place: no longer the size it is filed under
    del a
    b = workspace.empty(BIG, torch.float32, CPU)
    assert workspace.kept_bytes() == 2 << 20 and b.untyped_storage().nbytes() == 2 << 20
