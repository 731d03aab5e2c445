"""The process memory readers the warm-up and the benchmarks share."""

from __future__ import annotations

from widebeam.memstats import reset_peak_rss, rss_bytes


def test_rss_fields_are_read_in_bytes_and_the_peak_resets():
    now = rss_bytes("VmRSS")
    assert now is not None and now > 10 * 2**20  # a Python process with torch loaded
    assert reset_peak_rss(trim_heap=True) is True
    base = rss_bytes("VmRSS")  # after the trim, which may have given memory back
    ballast = bytearray(64 * 2**20)  # touched pages: the peak must see them
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    peak = rss_bytes("VmHWM")
    assert peak >= base + 48 * 2**20
    del ballast
    assert rss_bytes("NoSuchField") is None
