"""Host values onto the device without the host waiting for it (issue 40: a host loop that runs ahead of the GPU).

``torch.tensor(values, device="cuda")`` copies from pageable memory: the host blocks until the copy has run, and
the copy runs after every kernel queued before it, so a step that makes its index tensors that way can never run
ahead of the GPU. ``staged`` puts the values in page-locked memory and queues the copy (``non_blocking``): the host
goes on at once, and the kernels that read the tensor run after the copy, in stream order. PyTorch's pinned-memory
allocator keeps the block until the copy has run, so nothing is overwritten under it. On a CPU the values are
simply a tensor. The other way, a probability travels to the host in the step's one synchronisation as a whole
number of ``CHANCE_UNIT``s (``in_units``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def staged(values: Sequence | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list, or a host tensor) as a tensor on ``device``, copied without a host synchronisation."""
    pinned = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory() if pinned else values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=pinned)
    return host.to(device, non_blocking=True)


def in_order(rows: Sequence[int]) -> bool:
    """Whether ``rows`` are 0, 1, ... (a slice of the first slots: no index tensor needed)."""
    return all(r == i for i, r in enumerate(rows))


# The SLM's probability of a proposal as the host reads it back, in units of 2**-20 (an integer travels in the step's
# one synchronisation with the rest): the host's floats and a draft block's are then the same numbers.
CHANCE_UNIT = 2**20


def in_units(chance: torch.Tensor) -> torch.Tensor:
    """Probabilities in ``CHANCE_UNIT``s, rounded to whole ones (long), as the host reads them back: a draft
    block's rule reads its own the same way, so the host's and the device's rules read the same numbers."""
    return (chance * CHANCE_UNIT).round().long()
