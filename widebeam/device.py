"""The device the engine runs on by default, and the memory still free on it."""

from __future__ import annotations

import os

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_memory_bytes(device: torch.device) -> int:
    """Memory still free on the device: `mem_get_info` on CUDA, MemAvailable on a CPU host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
