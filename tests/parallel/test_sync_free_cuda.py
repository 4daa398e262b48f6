"""On a GPU: BASE's static expert-parallel path with the sync-free solver never makes the host
wait for the device, forward and backward (``torch.cuda.set_sync_debug_mode("error")`` raises
on any synchronising call), while the counted path does. One process, NCCL, an ep group of one."""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from moe import MoE, MoEConfig
from moe.parallel import parallelize_moe

pytestmark = pytest.mark.gpu


def step(layer: MoE, x: torch.Tensor) -> None:
    (layer(x) * 0.5).sum().backward()


@pytest.mark.parametrize("k", [1, 2])
def test_static_path_never_waits_for_the_device(tmp_path, k):
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("ep",))
        x = torch.randn(512, 64, device="cuda", requires_grad=True)
        for static, silent in ((True, True), (False, False)):
            torch.manual_seed(0)
            cfg = MoEConfig(
                dim=64,
                hidden_dim=128,
                num_experts=8,
                top_k=k,
                router="base",
                router_options={"base_solver": "approx", "base_extras": "lowest"},
            )
            layer = parallelize_moe(MoE(cfg).cuda(), mesh, static_splits=static)
            step(layer, x)  # warm-up: kernels compile, library handles are made
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                if silent:
                    step(layer, x)
                else:  # the counted path reads back (first the router's NaN check): syncs are seen
                    with pytest.raises(RuntimeError, match="synchroniz"):
                        step(layer, x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        dist.destroy_process_group()
