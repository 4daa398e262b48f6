"""What a script's last collectives leave for the interpreter's shutdown (gloo)."""

import threading
import time

import torch

from moe.parallel import layout


def test_released_by_gloo_waits_until_the_other_holder_lets_go():
    # stands in for gloo's worker thread, which still holds the tensor of a collective whose wait
    # returned: mean_over_dp must not hand the tensor back before that reference is gone (a
    # view holds its base's TensorImpl, as the worker's work holds the collective's tensors)
    t = torch.zeros(1)
    held = [t[:]]
    assert t._use_count() == 2

    def worker():
        time.sleep(0.05)
        held.clear()

    thread = threading.Thread(target=worker)
    thread.start()
    layout._released_by_gloo(t)
    assert t._use_count() == 1
    thread.join()


def test_released_by_gloo_gives_up_after_its_timeout():
    t = torch.zeros(1)
    view = t[:]
    start = time.monotonic()
    layout._released_by_gloo(t, timeout_s=0.05)
    assert 0.04 <= time.monotonic() - start < 1.0
    assert t._use_count() == 2 and view._base is t
