"""Fixtures of the data tests: two generated dataset files, made once per session."""

import pytest

from hpcnet.data.synthetic import generate_images, generate_tokens


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "images.h5"
    return generate_images(path, num_train=2000, num_eval=400, shape=(3, 16, 16), seed=0)


@pytest.fixture(scope="session")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.h5"
    return generate_tokens(path, num_train=400, num_eval=100, seq_len=32, vocab_size=64, seed=0)
