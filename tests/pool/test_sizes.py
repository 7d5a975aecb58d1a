"""Human byte sizes: what config files and flags accept, and how stats print them."""

from __future__ import annotations

import pytest

from kvtier.pool import format_size, parse_size


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30),
    ("512MiB", 512 * 2**20),
    ("1.5G", 1_500_000_000),          # decimal units are powers of ten
    ("1.5GiB", 3 * 2**29),
    ("4096", 4096),                   # a bare number is bytes
    ("64 kib", 64 * 1024),            # units are case-insensitive, space allowed
    (" 8MB ", 8_000_000),
    ("1TiB", 2**40),
    ("0", 0),
])
def test_parse_text(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("n", [0, 1, 4096, 2**40 + 3])
def test_parse_int_is_bytes(n):
    assert parse_size(n) == n


@pytest.mark.parametrize("bad", ["", "GiB", "2 GiBs", "12Q", "-1", "1e9", "1.2.3G", "two",
                                 -5, True, None, "0x10"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (512 * 2**20, "512.00 MiB"),
    (3 * 2**29, "1.50 GiB"), (2**41, "2.00 TiB"),
])
def test_format(n, text):
    assert format_size(n) == text


@pytest.mark.parametrize("n", [2**30, 256 * 2**20, 3 * 2**40])
def test_format_parses_back(n):
    # Whole-unit sizes survive a round trip through the printed form.
    assert parse_size(format_size(n)) == n
