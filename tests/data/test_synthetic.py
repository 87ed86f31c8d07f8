"""Tests of hpcnet.data.synthetic: the generated files, the command lines, and ensure_synthetic under MPI."""

import math
import runpy
import sys

import h5py
import numpy as np
import pytest

from hpcnet.data.h5 import open_split
from hpcnet.data.info import DatasetInfo
from hpcnet.data.loader import open_dataset
from hpcnet.data.synthetic import ensure_synthetic, generate_images, generate_tokens, main
from hpcnet.errors import DatasetError
from tests.helpers.data import load_split
from tests.helpers.launch import ROOT


def test_generated_layout(images, tokens):
    with h5py.File(images, "r") as f:
        assert (f.attrs["hpcnet_format"], f.attrs["kind"], f.attrs["num_classes"]) == (1, "image", 10)
        assert f["train/inputs"].shape == (2000, 3, 16, 16) and f["train/inputs"].dtype == np.float32
        assert f["eval/targets"].shape == (400,) and f["eval/targets"].dtype == np.int64
        assert f["train/inputs"].chunks[0] > 1
    with h5py.File(tokens, "r") as f:
        assert (f.attrs["kind"], f.attrs["num_classes"]) == ("tokens", 64)
        assert f["train/inputs"].dtype == f["train/targets"].dtype == np.int64
        x, y = f["train/inputs"][()], f["train/targets"][()]
        assert x.shape == y.shape == (400, 32)
        assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert not [p for p in images.parent.iterdir() if p.name.endswith(".tmp")]


def test_generation_is_deterministic(tmp_path, tokens):
    again = generate_tokens(tmp_path / "again.h5", num_train=400, num_eval=100, seq_len=32, vocab_size=64, seed=0)
    other = generate_tokens(tmp_path / "other.h5", num_train=400, num_eval=100, seq_len=32, vocab_size=64, seed=1)
    for split in ("train", "eval"):
        assert all(np.array_equal(a, b) for a, b in zip(load_split(tokens, split), load_split(again, split)))
        assert not np.array_equal(load_split(tokens, split)[0], load_split(other, split)[0])
    a = generate_images(tmp_path / "a.h5", num_train=64, num_eval=16, shape=(2, 8, 8), seed=2)
    b = generate_images(tmp_path / "b.h5", num_train=64, num_eval=16, shape=(2, 8, 8), seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(load_split(a, "train"), load_split(b, "train")))


def test_images_are_learnable_but_not_trivial(images):
    x, y = load_split(images, "train")
    xe, ye = load_split(images, "eval")
    assert 0.8 < x.std() < 1.2 and abs(x.mean()) < 0.1
    assert np.bincount(y, minlength=10).min() > 100
    means = np.stack([x[y == k].mean(axis=0) for k in range(10)])
    distances = ((xe[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
    accuracy = (distances.argmin(axis=1) == ye).mean()
    assert 0.3 < accuracy < 0.99, accuracy  # chance is 0.1


def test_tokens_are_learnable(tokens):
    x, y = load_split(tokens, "train")
    xe, ye = load_split(tokens, "eval")
    counts = np.ones((64, 64))  # a bigram model with add-one smoothing
    np.add.at(counts, (x.ravel(), y.ravel()), 1)
    log_prob = np.log(counts / counts.sum(axis=1, keepdims=True))
    loss = -log_prob[xe.ravel(), ye.ravel()].mean()
    assert loss < 0.6 * math.log(64), loss


def test_generator_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="num_train"):
        generate_tokens(tmp_path / "x.h5", num_train=0)
    with pytest.raises(ValueError, match="shape"):
        generate_images(tmp_path / "x.h5", shape=(32, 32))
    assert not list(tmp_path.iterdir())


def test_command_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cli.h5"
    assert main(["generate", "tokens", "--out", str(out), "--num-train", "32", "--num-eval", "8",
                 "--seq-len", "8", "--vocab-size", "16", "--seed", "4"]) == 0
    assert "cli.h5" in capsys.readouterr().out
    assert open_split(out, "eval").info == DatasetInfo("tokens", (8,), 16)
    with pytest.raises(SystemExit):
        main(["generate", "tokens", "--out", str(out), "--noise", "2"])
    script = tmp_path / "script.h5"
    monkeypatch.setattr(sys, "argv", ["generate.py", "images", "--out", str(script), "--num-train", "20",
                                      "--num-eval", "5", "--shape", "1", "4", "4", "--num-classes", "3"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "data" / "generate.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert open_split(script, "train").info == DatasetInfo("image", (1, 4, 4), 3)


# ---------------------------------------------------------------------------
# ensure_synthetic: any number of ranks


@pytest.fixture
def small_synthetic(monkeypatch):
    """Make the built-in generators write tiny files, so ensure_synthetic tests are fast."""
    tokens_small = generate_tokens
    images_small = generate_images
    from hpcnet.data import synthetic

    monkeypatch.setattr(synthetic, "generate_tokens",
                        lambda path, *, seed: tokens_small(path, num_train=64, num_eval=16, seq_len=8, seed=seed))
    monkeypatch.setattr(synthetic, "generate_images",
                        lambda path, *, seed: images_small(path, num_train=64, num_eval=16, shape=(1, 4, 4),
                                                           seed=seed))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_ensure_synthetic_gives_every_rank_the_same_file(comm, mpi_tmp_path, small_synthetic):
    path = ensure_synthetic("synthetic-tokens", mpi_tmp_path, comm=comm)
    assert path == mpi_tmp_path / "synthetic-tokens.h5"
    assert comm.allgather(str(path)) == [str(path)] * comm.Get_size()
    assert open_split(path, "train").info == DatasetInfo("tokens", (8,), 256)
    stamp = comm.bcast(path.stat().st_mtime_ns)
    assert ensure_synthetic("synthetic-tokens", mpi_tmp_path, comm=comm).stat().st_mtime_ns == stamp  # kept
    seeded = ensure_synthetic("synthetic-images", mpi_tmp_path, comm=comm, seed=2)
    assert seeded.name == "synthetic-images-seed2.h5"
    split = open_dataset("synthetic-images", "eval", directory=mpi_tmp_path, comm=comm)
    assert split.info == DatasetInfo("image", (1, 4, 4), 10) and len(split) == 16


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_unwritable_directory_fails_on_every_rank(comm, mpi_tmp_path, small_synthetic):
    blocker = mpi_tmp_path / "a-file"
    if comm.Get_rank() == 0:
        blocker.write_text("not a directory")  # fails even for root, unlike a read-only mode
    comm.Barrier()
    with pytest.raises(DatasetError) as error:
        ensure_synthetic("synthetic-images", blocker / "cache", comm=comm)
    message = str(error.value)
    assert "synthetic-images.h5" in message and "cannot create" in message
    assert comm.allgather(message) == [message] * comm.Get_size()
    with pytest.raises(DatasetError, match="not a built-in"):
        ensure_synthetic("synthetic-audio", mpi_tmp_path, comm=comm)


def test_module_command_line(tmp_path, capsys, monkeypatch):
    """``python -m hpcnet.data generate ...`` runs the same command line."""
    out = tmp_path / "module.h5"
    monkeypatch.setattr(sys, "argv", ["hpcnet.data", "generate", "tokens", "--out", str(out), "--num-train", "16",
                                      "--num-eval", "4", "--seq-len", "4", "--vocab-size", "8"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("hpcnet.data", run_name="__main__")
    assert exit_info.value.code == 0
    assert "module.h5" in capsys.readouterr().out
    assert open_split(out, "train").info == DatasetInfo("tokens", (4,), 8)
