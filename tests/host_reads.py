"""What a block of code reads back from its tensors on the host: a CPU-only model of the reads
``torch.cuda.set_sync_debug_mode`` reports.

Everything computed from the given source tensors (and from their results, and so on) is
tainted; a tensor made on the host, e.g. from a Python list, is not. Every host read of a
tainted value is recorded: ``item``/``int``/``float``/``bool``, ``tolist``, ``numpy``, the ops
whose output shape depends on values (on CUDA each of them waits for the device: nonzero,
masked_select, unique, bincount, repeat_interleave without output_size, equal, indexing with a
boolean mask), and a tainted ``counts_E`` passed to one of our ``moe::`` custom ops (they read
their counts on the host; what runs inside a custom op is hidden from a dispatch mode). Taint
follows storages, so views and in-place writes carry it, collectives taint every tensor they
touch, and ``torch.tensor(data, device=...)`` is recorded too (on CUDA a blocking copy).
Not seen: copies between host and device made otherwise (no-ops on CPU).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
_READS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.bincount.default,
    _aten.equal.default,
    _aten._unique2.default,
    _aten._unique.default,
    _aten.unique_dim_consecutive.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}


class HostReads(TorchDispatchMode):
    """``with HostReads(*sources) as r: ...`` then ``r.reads`` lists what was read, in order."""

    def __init__(self, *sources: torch.Tensor) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._kept: list = []  # tainted storages, alive so that their ids are never reused
        self._ids: set[int] = set()
        self._in_moe_op = False
        for t in sources:
            self._taint(t)

    @staticmethod
    def _storage(t: torch.Tensor):
        try:
            return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage: nothing to read
            return None

    def _taint(self, t: torch.Tensor) -> None:
        storage = self._storage(t)
        if storage is not None and storage._cdata not in self._ids:
            self._kept.append(storage)
            self._ids.add(storage._cdata)

    def tainted(self, t: torch.Tensor) -> bool:
        storage = self._storage(t)
        return storage is not None and storage._cdata in self._ids

    def _reads(self, func, args, kwargs) -> bool:
        if func in _READS:
            return True
        if func.namespace == "moe":  # our custom ops read their counts on the host
            names = [s.name for s in func._schema.arguments]
            return any(n == "counts_E" and self.tainted(a) for n, a in zip(names, args, strict=False))
        if func is _aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1]))
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        dirty = any(self.tainted(t) for t in inputs)
        if dirty and self._reads(func, args, kwargs):
            self.reads.append(str(func))
        inside, self._in_moe_op = self._in_moe_op, self._in_moe_op or func.namespace == "moe"
        try:  # a moe:: op's own reads (its counts' tolist) are recorded once, as the op
            out = func(*args, **kwargs)
        finally:
            self._in_moe_op = inside
        if dirty:
            schema = func._schema.arguments  # positional arguments the op writes to
            written = [a for a, s in zip(args, schema, strict=False) if s.alias_info and s.alias_info.is_write]
            if func.namespace == "c10d":  # collectives write their outputs without saying so
                written = list(tree_leaves(args))
            for t in [*tree_leaves(out), *written]:
                if isinstance(t, torch.Tensor):
                    self._taint(t)
        return out

    def __enter__(self):
        self._patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        self._tensor = torch.tensor
        mode = super().__enter__()
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, self._recording(name, method))
        torch.tensor = self._blocking_copy
        return mode

    def __exit__(self, *exc):
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, method)
        torch.tensor = self._tensor
        return super().__exit__(*exc)

    def _blocking_copy(self, data, *args, **kwargs):
        if kwargs.get("device") is not None:
            self.reads.append("torch.tensor(device=...)")
        return self._tensor(data, *args, **kwargs)

    def _recording(self, name: str, method):
        def read(t, *args, **kwargs):
            if self.tainted(t) and not self._in_moe_op:
                self.reads.append(f"Tensor.{name}")
            return method(t, *args, **kwargs)

        return read
