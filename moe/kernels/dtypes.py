"""The dtypes the grouped-GEMM paths take, in a module of its own so that `grouped_mm` (which
loads the Triton launchers lazily) and `triton_grouped_mm` both read it and neither imports
the other at load time: imports point one way, grouped_mm -> triton_grouped_mm."""

import torch

__all__ = ["MATMUL_DTYPES"]

# what torch._grouped_mm and the Triton kernels take (no fp64: neither has a kernel for it)
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
