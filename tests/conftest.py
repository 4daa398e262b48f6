import os

import torch

# Triton kernels run on CPU through Triton's interpreter when there is no GPU; it must be
# chosen before triton loads (importing torch does not load it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# under pytest-xdist each worker's in-process tests get their share of the cores, so that two
# workers do not run four intra-op threads on two cores
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# the test processes keep at most 2 GiB of the layers' results between calls, not a quarter of
# the machine each: the suite's shapes are small, and its many shapes would fill a larger limit
from moe.kernels import workspace  # noqa: E402

workspace.set_limit(2 << 30)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# "ci" keeps the suite fast on 2 cores; "dev" runs many more examples: HYPOTHESIS_PROFILE=dev
settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# the files that run the most subprocesses go first, so that under pytest-xdist's loadfile
# schedule the long files start early and the short ones fill in at the end (the order within a
# file is kept, and no test depends on another file's)
_FIRST = ("tests/train/test_layouts.py", "tests/train/", "tests/parallel/", "tests/adapters/")


def _weight(item) -> int:
    path = item.nodeid.split("::")[0]
    return next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_weight)  # stable: files keep their order within each group
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
