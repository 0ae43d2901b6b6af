"""The machine record every report carries: CPU and its relevant instruction sets, GPU, versions, dtype."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from ..models.hardware import cpu_flags

# the flags that decide what runs fast here: bf16 is native only with avx512_bf16 or amx_bf16
RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where that cannot be read)."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:  # not Linux
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_record(device: torch.device | str | None = None, dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """Where and with what a measurement was taken (JSON-ready)."""
    import transformers

    from .. import __version__

    flags = cpu_flags()
    record: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_flags": [f for f in RELEVANT_CPU_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_specdec": __version__,
        "device": None if device is None else str(device),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
    }
    if torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name(0)
        record["cuda"] = torch.version.cuda
    return record
