"""The kernel counter of benchmarks/speed/kernel_counts.py: it counts work, not views, and the server's slot read
launches fewer kernels than generate's HF-static-cache read (one prepared mask for every layer, not one per layer)."""

import torch

from benchmarks.speed.kernel_counts import Kernels, generate_read, slot_read
from benchmarks.synthetic import random_model


def test_views_are_free_and_work_is_counted():
    x = torch.ones(4, 4, device="meta")
    with Kernels() as kernels:
        x.view(16).reshape(2, 8).t()
        (x + 1).sum()
    assert dict(kernels.counts) == {"add": 1, "sum": 1}


def test_the_slot_read_launches_fewer_kernels_than_generates_read():
    model = random_model("tiny", torch.bfloat16, "meta", seed=0)
    model.config._attn_implementation = "sdpa"
    ours, theirs = sum(slot_read(model, 1, 1, 32, True).values()), sum(generate_read(model, 1, 1, 32, True).values())
    assert 0 < ours < theirs


def test_fused_reads_launch_fewer_kernels_and_one_layer_serves_all():
    # tiny shapes (2 layers): one compiled layer is called for both, and the fused read launches fewer kernels
    # than HF's forward on either cache (counted as benchmarks/speed/kernel_counts.py counts the real shapes)
    from benchmarks.speed.kernel_counts import fused_read

    model = random_model("tiny", torch.bfloat16, "meta", seed=0)
    model.config._attn_implementation = "sdpa"
    for server, hf in ((False, generate_read), (True, slot_read)):
        found = fused_read("tiny", 1, 1, 32, True, server)
        theirs = sum(hf(model, 1, 1, 32, True).values())
        assert 0 < found["kernels"] < theirs / 2, (found, theirs)
        assert found["outside"] <= 2, found["outside_top"]  # the mask and lengths are made inside the regions
        layer = found["per_region"]["slot_layer" if server else "static_layer"]
        assert found["kernels"] == found["outside"] + sum(found["per_region"].values()) + layer * (found["layers"] - 1)
