"""Where a benchmark ran, as its JSON records it: the versions that decide the numbers and the machine's name."""

from __future__ import annotations

import platform


def versions() -> dict[str, str]:
    """torch's and transformers' versions (imported here: every room's results name them)."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def hardware(device: str = "cpu") -> str:
    """The GPU's name on CUDA, else the processor's (its architecture where the platform names no processor)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()
