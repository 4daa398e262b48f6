"""Expert compute: grouped GEMM over expert-sorted rows, and the permutation around it.

Imports nothing else of ``moe``. Each op has a pure-torch reference in `reference`.
"""

from .activation import swiglu
from .expert_ffn import swiglu_ffn
from .fused import gather_grouped_mm, grouped_mm_scatter
from .grouped_mm import BACKENDS, grouped_mm
from .permute import PermuteInfo, permute, permute_rows, sort_slots, unpermute
from .reference import grouped_mm_ref, permute_ref, unpermute_ref

__all__ = [
    "BACKENDS",
    "PermuteInfo",
    "gather_grouped_mm",
    "grouped_mm",
    "grouped_mm_ref",
    "grouped_mm_scatter",
    "permute",
    "permute_ref",
    "permute_rows",
    "sort_slots",
    "swiglu",
    "swiglu_ffn",
    "unpermute",
    "unpermute_ref",
]
