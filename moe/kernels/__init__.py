"""Expert compute: grouped GEMM over expert-sorted rows, and the permutation around it.

Imports nothing else of ``moe``. Each op has a pure-torch reference in `reference`.
"""

from .grouped_mm import BACKENDS, grouped_mm
from .permute import PermuteInfo, permute, unpermute
from .reference import grouped_mm_ref, permute_ref, unpermute_ref

__all__ = [
    "BACKENDS",
    "PermuteInfo",
    "grouped_mm",
    "grouped_mm_ref",
    "permute",
    "permute_ref",
    "unpermute",
    "unpermute_ref",
]
