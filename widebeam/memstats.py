"""This process's memory figures on a Linux host, for the warm-up and the benchmarks.

Read from /proc; every reader returns None (or False) where /proc or the field is missing, so
callers can fall back to an estimate instead of failing.
"""

from __future__ import annotations

import ctypes


def rss_bytes(field: str = "VmRSS") -> int | None:
    """A /proc/self/status memory field in bytes: VmRSS (resident now) or VmHWM (peak since reset)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss(trim_heap: bool = False) -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported.

    `trim_heap` first hands heap the allocator freed but kept back to the OS, so the next peak does
    not start at an earlier run's leftovers (for side-by-side benchmarks).
    """
    if trim_heap:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False
