"""On a GPU: the chunked dispatcher's side-stream exchanges give chunks=1's outputs and
gradients, forward and backward. One process, NCCL, an ep group of one (the exchange is a
loopback, but it still runs on the side stream, ordered by events)."""

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from moe import MoE, MoEConfig
from moe.parallel import parallelize_moe

pytestmark = pytest.mark.gpu


def test_chunks_equal_one_chunk_on_cuda(tmp_path):
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("ep",))
        torch.manual_seed(0)
        base = MoE(MoEConfig(dim=64, hidden_dim=128, num_experts=8, top_k=2, router="topk")).cuda()
        x_in = torch.randn(1000, 64, device="cuda")
        results = {}
        for chunks in (1, 4):
            layer = parallelize_moe(copy.deepcopy(base), mesh, chunks=chunks)
            x = x_in.clone().requires_grad_()
            y = layer(x)
            (y * torch.linspace(-1, 1, 64, device="cuda")).sum().backward()
            grads = {
                n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in layer.named_parameters()
            }
            results[chunks] = (y.detach(), x.grad, grads)
        (y1, gx1, g1), (y4, gx4, g4) = results[1], results[4]
        torch.testing.assert_close(y4, y1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gx4, gx1, rtol=1e-4, atol=1e-5)
        for name, grad in g4.items():
            torch.testing.assert_close(grad, g1[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        dist.destroy_process_group()
