"""The shared argparse types (widebeam/argtypes.py): `positive_float`, finite or with `inf` allowed."""

from __future__ import annotations

import argparse
import math

import pytest

from widebeam.argtypes import positive_float


@pytest.mark.parametrize("allow_inf, text, expected", [
    (False, "2.5", 2.5), (False, "1e-3", 1e-3), (True, "inf", math.inf), (True, "7", 7.0),
])
def test_positive_float_accepts(allow_inf, text, expected):
    assert positive_float(allow_inf)(text) == expected


@pytest.mark.parametrize("allow_inf, text", [
    (False, "0"), (False, "-1"), (False, "inf"), (False, "nan"), (False, "fast"), (True, "0"), (True, "nan"),
])
def test_positive_float_refuses(allow_inf, text):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_float(allow_inf)(text)
