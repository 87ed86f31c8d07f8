"""hpcnet.bench.common: sizes, the bandwidth formulas, summaries and tables (pure)."""

import pytest

from hpcnet.bench.common import algbw, busbw, format_size, parse_size, size_sweep, summarize, table


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("1KiB", 1024), ("64KiB", 65536), ("64k", 65536), ("25MiB", 25 * 2**20), ("25 MiB", 25 * 2**20),
    ("1.5GiB", 3 * 2**29), ("1KB", 1000), ("2MB", 2_000_000), ("256mib", 256 * 2**20),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 apples", "0", "0.3B", "-4KiB", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size_round_trips():
    for nbytes in (1, 1000, 1024, 65536, 25 * 2**20, 3 * 2**29):
        assert parse_size(format_size(nbytes)) == nbytes
    assert format_size(25 * 2**20) == "25MiB"


def test_size_sweep():
    sizes = size_sweep(2**10, 2**28, 4, extra=(25 * 2**20, 2**30))
    assert sizes[0] == 2**10 and sizes[-1] == 2**28 and 25 * 2**20 in sizes
    assert 2**30 not in sizes and len(sizes) == 11 and sizes == sorted(set(sizes))
    assert size_sweep(1000, 1000, 2) == [1000]
    with pytest.raises(ValueError):
        size_sweep(10, 1, 2)
    with pytest.raises(ValueError):
        size_sweep(1, 10, 1)


def test_bandwidth_formulas_follow_nccl_tests():
    assert algbw(2 * 10**9, 2.0) == 10**9
    assert busbw(10**9, 1.0, 2) == pytest.approx(1e9)  # 2(n-1)/n = 1 for two ranks
    assert busbw(10**9, 1.0, 4) == pytest.approx(1.5e9)
    assert busbw(10**9, 1.0, 8) == pytest.approx(1.75e9)
    assert busbw(10**9, 1.0, 1) == 0.0  # one rank moves nothing


def test_summarize_and_table():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "spread": pytest.approx(3.6)}
    with pytest.raises(ValueError):
        summarize([])
    text = table(["size", "GB/s"], [["1KiB", "0.1"], ["256MiB", "12.25"]])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].startswith("------") and lines[3].endswith("12.25")
