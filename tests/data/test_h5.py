"""Tests of hpcnet.data.h5: reading rows, and every malformed file named in its error."""

import h5py
import numpy as np
import pytest
import torch

from hpcnet.data.h5 import open_split
from hpcnet.data.info import DatasetInfo
from hpcnet.errors import DatasetError
from tests.helpers.data import load_split, write_dataset


def test_read_keeps_the_given_order(images):
    x, y = load_split(images, "train")
    with open_split(images, "train") as split:
        assert split.info == DatasetInfo("image", (3, 16, 16), 10) and len(split) == 2000
        for rows in ([5, 2, 1999, 0, 2], [7, 8, 9, 10], [3], [4, 100, 1000]):
            inputs, targets = split.read(np.array(rows))
            assert inputs.dtype == torch.float32 and targets.dtype == torch.int64
            assert np.array_equal(inputs.numpy(), x[rows]) and np.array_equal(targets.numpy(), y[rows])
        inputs, targets = split.read(np.array([], dtype=np.int64))
        assert inputs.shape == (0, 3, 16, 16) and targets.shape == (0,)
        with pytest.raises(IndexError, match="out of range"):
            split.read(np.array([0, 2000]))
        with pytest.raises(TypeError):
            split.read(np.array([0.5]))


def break_attr(name):
    def make(path):
        write_dataset(path)
        with h5py.File(path, "a") as f:
            del f.attrs[name]
    return make


MALFORMED = {
    "missing": (lambda p: None, "does not exist"),
    "not hdf5": (lambda p: p.write_text("hello"), "not an HDF5 file"),
    "directory": (lambda p: p.mkdir(), "not a regular file"),
    "no format": (break_attr("hpcnet_format"), "'hpcnet_format' is missing"),
    "no kind": (break_attr("kind"), "'kind' is missing"),
    "no classes": (break_attr("num_classes"), "'num_classes' is missing"),
    "format 2": (lambda p: write_dataset(p, attrs={"hpcnet_format": 2}), "format 1"),
    "bad kind": (lambda p: write_dataset(p, attrs={"kind": "audio"}), "'audio'"),
    "zero classes": (lambda p: write_dataset(p, attrs={"num_classes": 0}), "num_classes is 0"),
    "no group": (lambda p: write_dataset(p, drop=("train",)), "group '/train' is missing"),
    "no inputs": (lambda p: write_dataset(p, drop=("train/inputs",)), "'/train/inputs' is missing"),
    "no targets": (lambda p: write_dataset(p, drop=("train/targets",)), "'/train/targets' is missing"),
    "length mismatch": (lambda p: write_dataset(p, train_targets=np.zeros(7, np.int64)), "8 rows but"),
    "int images": (lambda p: write_dataset(p, train_inputs=np.zeros((8, 1, 2, 2), np.int32)), "floating point"),
    "float targets": (lambda p: write_dataset(p, train_targets=np.zeros(8, np.float32)), "must be integers"),
    "2-d image targets": (lambda p: write_dataset(p, train_targets=np.zeros((8, 2), np.int64)), "must be [N]"),
    "float tokens": (lambda p: write_dataset(p, kind="tokens", train_inputs=np.zeros((8, 4))), "must be integers"),
    "token shapes": (lambda p: write_dataset(p, kind="tokens", train_targets=np.zeros((8, 3), np.int64)),
                     "shape of the inputs"),
    "target too big": (lambda p: write_dataset(p, train_targets=np.full(8, 3)), "holds 3"),
    "negative target": (lambda p: write_dataset(p, train_targets=np.array([0] * 7 + [-1])), "holds -1"),
    "token out of range": (lambda p: write_dataset(p, kind="tokens", train_inputs=np.full((8, 4), 9)), "holds 9"),
    "empty": (lambda p: write_dataset(p, n=0), "is empty"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_is_a_dataset_error_naming_it(tmp_path, case):
    make, fragment = MALFORMED[case]
    path = tmp_path / "bad-file.h5"
    make(path)
    with pytest.raises(DatasetError) as error:
        open_split(path, "train")
    assert "bad-file.h5" in str(error.value) and fragment in str(error.value)


def test_bad_rows_found_on_read(tmp_path):
    targets = np.zeros(300_000, np.int64)
    targets[150_000] = 7  # between the first and last rows checked on open
    path = write_dataset(tmp_path / "late.h5", n=300_000, train_targets=targets)
    split = open_split(path, "train")
    split.read(np.array([1, 2]))
    with pytest.raises(DatasetError, match="late.h5.*holds 7"):
        split.read(np.array([149_999, 150_000]))
