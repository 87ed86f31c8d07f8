"""Tests of hpcnet.data.info: DatasetInfo's checks, the integer predicates, the Split protocol, no torch at import."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from hpcnet.data.h5 import open_split
from hpcnet.data.info import DATASET_KINDS, DatasetInfo, Split, is_int, is_integer, positive_ints
from tests.helpers.data import write_dataset
from tests.helpers.launch import ROOT, clean_env


def test_dataset_info_is_a_hashable_value():
    info = DatasetInfo("image", [3, 8, 8], 10)
    assert info.input_shape == (3, 8, 8)
    assert info == DatasetInfo("image", (3, 8, 8), 10) and hash(info) == hash(DatasetInfo("image", (3, 8, 8), 10))
    assert DATASET_KINDS == ("image", "tokens")
    with pytest.raises(AttributeError):
        info.num_classes = 3


@pytest.mark.parametrize(("args", "fragment"), [
    (("audio", (3,), 2), "kind must be one of image, tokens, sequence, other, got 'audio'"),
    (("image", (), 2), "input_shape must be positive integers"),
    (("image", (3, 0, 8), 2), "input_shape must be positive integers"),
    (("image", (True, 8, 8), 2), "input_shape must be positive integers"),
    (("image", (3, 8.0, 8), 2), "input_shape must be positive integers"),
    (("tokens", (4, 4), 2), "must be (T,) for tokens data"),
    (("tokens", (4,), 0), "num_classes must be a positive integer, got 0"),
    (("tokens", (4,), True), "num_classes must be a positive integer, got True"),
])
def test_dataset_info_rejects_what_no_model_can_use(args, fragment):
    with pytest.raises(ValueError) as error:
        DatasetInfo(*args)
    assert fragment in str(error.value)


def test_integer_predicates():
    assert is_int(3) and not is_int(True) and not is_int(3.0) and not is_int(np.int64(3))
    assert is_integer(3) and is_integer(np.int64(3)) and is_integer(np.uint8(3))
    assert not is_integer(True) and not is_integer(np.bool_(True)) and not is_integer(3.0)
    positive_ints(a=1, b=np.int32(2))
    with pytest.raises(ValueError, match="b must be a positive integer, got 0"):
        positive_ints(a=1, b=0, c=-1)
    with pytest.raises(ValueError, match="a must be a positive integer"):
        positive_ints(a="1")


def test_split_protocol(tmp_path):
    class Rows:
        info = DatasetInfo("tokens", (2,), 5)

        def __len__(self):
            return 3

        def read(self, indices):
            return torch.zeros(len(indices), 2, dtype=torch.int64), torch.zeros(len(indices), 2, dtype=torch.int64)

    class NoRead:
        info = DatasetInfo("tokens", (2,), 5)

        def __len__(self):
            return 3

    with open_split(write_dataset(tmp_path / "ok.h5"), "train") as split:
        assert isinstance(split, Split)
    assert isinstance(Rows(), Split) and not isinstance(NoRead(), Split)


def test_the_generator_imports_no_torch():
    """``python -m hpcnet.data generate`` and data/generate.py stay quick: info and synthetic need no torch."""
    code = "import sys, hpcnet.data.info, hpcnet.data.synthetic; sys.exit('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
