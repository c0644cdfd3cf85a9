"""The host work per decoding step, counted (``benchmarks/speed/host_ops.py``, issue 40): the counter tells a syncing
copy, a read and a device op apart as a GPU would pay them, today's counts are the bounds a change may not exceed, and
the issue's targets hold (no syncing copy and at most 40 eager ops per served step, at most 20 per generate step)."""

import math

import pytest
import torch

from benchmarks.speed.host_count import Counter, counting_steps


def test_the_counter_tells_copies_reads_and_device_ops_apart():
    device, x = torch.device("cpu"), torch.arange(8.0)
    counter = Counter()
    with counter:
        rows = torch.tensor([1, 2], device=device)  # h2d: a host list onto the decoding device
        y = x[rows] * 2  # two device ops
        host = torch.tensor([3, 4])  # a host tensor: nothing yet
        x[host]  # h2d: a host index beside device data (and the index op)
        host.to(device, non_blocking=True)  # an asynchronous copy (pinned on a GPU)
        x[[0, 1]]  # h2d: a list index becomes a tensor copied over (and the index op)
        y.sum().item()  # a read (and the sum)
        y.tolist()  # a read
        x.view(2, 4)  # a view: nothing
        host + 1  # host work: nothing
        (x > 3).nonzero()  # the comparison, and a read: nonzero sizes its output on the host
        x[1] = 5.0  # a device op (a fill), no copy
        torch.arange(2) + host  # host work: a factory without a device makes a host tensor
        x[host.to(torch.long)]  # a cast on the host, then a copy over (and the index op)
    c = counter.counts
    assert (c.h2d, c.h2d_async, c.d2h) == (4, 1, 3)
    assert dict(c.ops) == {"index": 4, "mul": 1, "sum": 1, "gt": 1, "copy_": 1} and c.eager == 8


def test_a_staged_copy_is_asynchronous_and_gives_a_device_tensor():
    from r2r_hf.core.staging import staged

    device, x = torch.device("cpu"), torch.arange(8.0)
    counter = Counter()
    with counter:
        x[staged([1, 2], device)]  # one asynchronous copy, then an index op on the device
        x[staged(torch.tensor([3, 4]), device)]  # the same from a host tensor
    c = counter.counts
    assert (c.h2d, c.h2d_async, c.d2h) == (0, 2, 0) and dict(c.ops) == {"index": 2}


def test_a_cast_or_a_copying_view_counts_as_the_copy_it_launches():
    x, flags = torch.arange(8.0), torch.arange(8) > 3
    counter = Counter()
    with torch.inference_mode(), counter:
        x.to(torch.float32)  # already float32: the same tensor back, nothing runs
        x.reshape(2, 4)  # a view
        flags.long()  # a cast: one kernel
        x.to(torch.float32, copy=True)  # a copy
        x.view(2, 4).t().contiguous()  # a transposed copy
    assert dict(counter.counts.ops) == {"to": 2, "contiguous": 1}


def test_a_graph_replay_counts_once_and_nothing_inside_it_counts():
    from r2r_hf.testing.graphs import EmulatedPool

    counter = Counter()
    step = counting_steps(counter)(lambda a: (torch.relu(a * 2 + 1).sum(0),), {"a": torch.ones(4, 3)}, EmulatedPool())
    fresh = torch.zeros(4, 3)  # made before counting: a device tensor (one made inside without a device is a host one)
    with counter:
        step(a=fresh)
    c = counter.counts
    assert c.replays == 1 and c.h2d == c.d2h == 0
    assert dict(c.ops) == {"copy_": 1, "clone": 1}, "the copy into its static input and out of its output only"
    step(a=torch.ones(4, 3))
    assert c.replays == 1, "a replay while the counter is off is not counted"


# The counts per step reached (benchmarks/results/host_ops.json, issue 40 item 3: the host loop runs ahead of the GPU)
# as upper bounds: a change may lower them, not raise them. Before it: generate 35 / 45 eager ops per step and 0 / 2
# syncing copies, the server 86.9 / 91.5 eager ops and 10.0 / 11.1 syncing copies at 8 / 16 rows.
BOUNDS = {
    ("generate_1", "slm step (never routes)"): {"h2d_syncing": 0, "d2h_reads": 1, "eager_ops": 11},
    ("generate_1", "llm step (every token routed)"): {"h2d_syncing": 0, "d2h_reads": 1, "eager_ops": 15},
    # (+0.4 / +0.5 since the LLM's reads gather their rows: the gathered ids, one index_select per such read)
    ("server", "8 rows, p = 0.1"): {"h2d_syncing": 0, "d2h_reads": 1, "eager_ops": 19.625},
    ("server", "16 rows, p = 0.1"): {"h2d_syncing": 0, "d2h_reads": 1, "eager_ops": 20.75},
}
# The targets: no syncing copy and at most 40 eager ops per served step (the one read-back stays), at most 20
# per generate step.
TARGETS = {"generate_1": {"h2d_syncing": 0, "d2h_reads": 1, "eager_ops": 20},
           "server": {"h2d_syncing": 0, "d2h_reads": 1, "eager_ops": 40}}


@pytest.fixture(scope="module")
def found():
    from benchmarks.speed.host_ops import measure

    torch.set_num_threads(1)
    return measure(rows=(8, 16), steps=16, routings={"p = 0.1": 0.9})


def test_host_work_per_step_stays_within_the_counts_reached(found):
    for (section, name), bound in BOUNDS.items():
        got = found[section][name]
        for key, most in bound.items():
            # A routing decision that flips on another CPU's rounding moves a p = 0.1 average by 1/16 at most.
            assert got[key] <= most + (1 / 16 if "p =" in name else 0) + 1e-9, (section, name, key, got[key])
        # Times are measured, not bounded: generate's host_ms is a difference of two timings, which a loaded machine
        # turned negative once (the suite beside a benchmark); the counts above are what this test holds.
        assert got["graph_replays"] >= 1 and math.isfinite(got["host_ms"]) and got["decide_ms"] >= 0
    reads = {site: n for site, n in found["server"]["8 rows, p = 0.1"]["sites"].items() if site.startswith("d2h ")}
    site = next(iter(reads))
    assert list(reads.values()) == [1] and site.startswith("d2h r2r_hf/core/batch.py:") and site.endswith(" sync"), \
        f"the one read-back, the step's synchronisation: {reads}"


def test_the_host_loop_stays_within_its_per_step_targets(found):
    for section, target in TARGETS.items():
        for name, got in found[section].items():
            for key, most in target.items():
                assert got[key] <= most, (section, name, key, got[key])
            assert got["d2h_reads"] == 1, (section, name, "the step's one read-back")
    for name, got in found["server"].items():  # its index tensors are staged: copies the host does not wait for
        assert got["h2d_async"] > 0 and all(not site.startswith("h2d ") for site in got["sites"]), (name, got["sites"])
