"""What a block of code reads back from its tensors on the host: a CPU-only stand-in for
``torch.cuda.set_sync_debug_mode``.

Everything computed from the given source tensors (and from their results, and so on) is
tainted; a tensor made on the host, e.g. from a Python list, is not. Every host read of a
tainted value is recorded: ``item``/``int``/``float``/``bool``, ``tolist``, ``numpy``, and the
ops whose output shape depends on values (on CUDA each of them waits for the device): nonzero,
masked_select, unique, bincount, repeat_interleave without output_size, equal, and indexing
with a boolean mask. Taint follows storages, so views and in-place writes carry it.
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
        for t in sources:
            self._taint(t)

    @staticmethod
    def _storage(t: torch.Tensor):
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    def _taint(self, t: torch.Tensor) -> None:
        storage = self._storage(t)
        if storage._cdata not in self._ids:
            self._kept.append(storage)
            self._ids.add(storage._cdata)

    def tainted(self, t: torch.Tensor) -> bool:
        return self._storage(t)._cdata in self._ids

    def _reads(self, func, args, kwargs) -> bool:
        if func in _READS:
            return True
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
        out = func(*args, **kwargs)
        if dirty:
            schema = func._schema.arguments  # positional arguments the op writes to
            written = [a for a, s in zip(args, schema, strict=False) if s.alias_info and s.alias_info.is_write]
            for t in [*tree_leaves(out), *written]:
                if isinstance(t, torch.Tensor):
                    self._taint(t)
        return out

    def __enter__(self):
        self._patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, self._recording(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _recording(self, name: str, method):
        def read(t, *args, **kwargs):
            if self.tainted(t):
                self.reads.append(f"Tensor.{name}")
            return method(t, *args, **kwargs)

        return read
