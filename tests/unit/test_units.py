import pytest

from widebeam.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("1024", 1024), ("64MiB", 64 * 2**20), ("1.5GB", 1_500_000_000), ("141GiB", 141 * 2**30),
     ("2g", 2 * 2**30), (" 10 KiB ", 10240), (4096, 4096)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-5MiB", "1.2.3GB", True, -1])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(12) == "12 B"
