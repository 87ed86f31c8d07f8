"""Tests of hpcnet.data.arrays' CRC-32 of rows read in any order: the same value as zlib over the bytes."""

import zlib

import numpy as np
import pytest

from hpcnet.data.arrays import crc32_combine, fold_rows, row_crcs


def test_combine_is_zlibs():
    a, b = b"hpcnet reads ", b"members in place"
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)


@pytest.mark.parametrize("row_bytes", [1, 8, 16, 17, 300])  # byte columns up to 16 bytes, zlib per row beyond
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 1001])  # odd counts leave pieces aside at some levels
def test_rows_folded_in_any_order_give_the_crc_of_the_whole(rows, row_bytes):
    data = np.random.default_rng(rows * 1000 + row_bytes).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    crcs = row_crcs(data)
    assert [int(c) for c in crcs] == [zlib.crc32(row.tobytes()) for row in data]
    shuffled = np.random.default_rng(0).permutation(rows)
    by_row = np.empty(rows, np.uint32)
    by_row[shuffled] = row_crcs(data[shuffled])  # computed in a shuffled order, folded in row order
    assert fold_rows(by_row, row_bytes) == zlib.crc32(data.tobytes())
