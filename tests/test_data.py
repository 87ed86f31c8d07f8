"""Tests of hpcnet.data: sampling maths on one process, files and loaders, and collective opening under MPI."""

import math
import os
import runpy
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcnet.data import loader as data
from hpcnet.data.loader import (BatchLoader, GlobalBatchSampler, H5Split, TorchDatasetSplit, eval_indices,
                                open_dataset, open_split)
from hpcnet.data.synthetic import ensure_synthetic, generate_images, generate_tokens, main
from hpcnet.errors import ConfigError, DatasetError
from hpcnet.models import DatasetInfo

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# sampling: pure, every world size in one process


def samplers(num_samples, batch_size, world_size, **kwargs):
    return [GlobalBatchSampler(num_samples, batch_size, rank=r, world_size=world_size, **kwargs)
            for r in range(world_size)]


def global_batch(ranks):
    """One step on every rank, concatenated in rank order."""
    return np.concatenate([s.next_indices() for s in ranks])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_sampler_covers_every_sample_once_per_epoch(world_size):
    ranks = samplers(50, 3, world_size, seed=7)
    steps = ranks[0].steps_per_epoch
    assert steps == 50 // (3 * world_size)
    for epoch in range(2):
        seen = []
        for step in range(steps):
            for rank in ranks:
                indices = rank.next_indices()
                assert indices.shape == (3,) and indices.dtype == np.int64
                assert rank.epoch == epoch and rank.samples_in_epoch == (step + 1) * 3 * world_size
                seen.append(indices)
        seen = np.concatenate(seen)
        assert len(np.unique(seen)) == len(seen) == steps * 3 * world_size  # the tail is dropped, nothing repeats
        assert seen.min() >= 0 and seen.max() < 50


def test_epochs_differ_and_seed_is_deterministic():
    a = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=3)
    b = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=3)
    c = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=4)
    assert np.array_equal(a.epoch_order(0), b.epoch_order(0))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert not np.array_equal(a.epoch_order(0), c.epoch_order(0))
    assert sorted(a.epoch_order(5)) == list(range(100))
    stream_a = [a.next_indices() for _ in range(25)]
    stream_b = [b.next_indices() for _ in range(25)]
    assert all(np.array_equal(x, y) for x, y in zip(stream_a, stream_b))
    ordered = GlobalBatchSampler(100, 10, rank=0, world_size=1, shuffle=False)
    assert np.array_equal(ordered.epoch_order(3), np.arange(100))
    assert np.array_equal(ordered.next_indices(), np.arange(10))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_global_batch_equals_one_rank_batch(world_size):
    ranks = samplers(103, 4, world_size, seed=11)
    single = GlobalBatchSampler(103, 4 * world_size, rank=0, world_size=1, seed=11)
    for _ in range(3 * single.steps_per_epoch + 1):  # across epoch boundaries
        assert np.array_equal(global_batch(ranks), single.next_indices())


def sample_stream(ranks, num_samples):
    out = []
    while sum(len(x) for x in out) < num_samples:
        out.append(global_batch(ranks))
    return np.concatenate(out)[:num_samples]


@pytest.mark.parametrize(("new_batch", "new_world"), [(4, 2), (2, 4), (8, 1), (1, 8), (2, 2), (16, 1)])
def test_resume_mid_epoch_at_any_world_size(new_batch, new_world):
    # 48 samples: every global batch size here divides it, so epochs drop no tail and streams can be compared.
    reference = samplers(48, 4, 2, seed=5)
    for _ in range(2):
        global_batch(reference)  # 16 samples into epoch 0
    state = reference[0].state_dict()
    assert state == {"epoch": 0, "samples_consumed_in_epoch": 16, "seed": 5}
    resumed = samplers(48, new_batch, new_world, seed=999)  # the saved seed wins
    for s in resumed:
        s.load_state_dict(state)
    assert np.array_equal(sample_stream(resumed, 80), sample_stream(reference, 80))


def advance(ranks, steps):
    for _ in range(steps):
        global_batch(ranks)
    return ranks[0].state_dict()


@pytest.mark.parametrize("saved_world, new_world", [(2, 3), (4, 3), (3, 2), (1, 5), (2, 2)])
@pytest.mark.parametrize("new_batch", [4, 5])
def test_resume_in_another_batch_grid_continues_the_same_order(saved_world, new_world, new_batch):
    """A position that is no whole number of the new global batches: same order on, new grid, tail dropped."""
    n = 101  # a prime: no global batch divides it, every epoch drops a tail
    state = advance(samplers(n, 4, saved_world, seed=3), 3)
    position = 3 * 4 * saved_world
    assert state == {"epoch": 0, "samples_consumed_in_epoch": position, "seed": 3}
    resumed = samplers(n, new_batch, new_world, seed=0)
    for s in resumed:
        s.load_state_dict(state)
    order, g = resumed[0].epoch_order(0), new_batch * new_world
    left = (n - position) // g
    for k in range(left):
        assert np.array_equal(global_batch(resumed), order[position + k * g:position + (k + 1) * g])
        assert resumed[0].epoch == 0 and resumed[0].samples_in_epoch == position + (k + 1) * g
    # Fewer than g samples are left: dropped, as at any epoch end; a save now names the next epoch.
    assert n - (position + left * g) < g
    assert resumed[0].state_dict() == {"epoch": 1, "samples_consumed_in_epoch": 0, "seed": 3}
    fresh = samplers(n, new_batch, new_world, seed=3)
    advance(fresh, fresh[0].steps_per_epoch)  # epoch 0 from its start
    for _ in range(fresh[0].steps_per_epoch + 1):  # epoch 1 and into epoch 2 are a fresh run's
        assert np.array_equal(global_batch(resumed), global_batch(fresh))
    assert resumed[0].epoch == 2


@pytest.mark.parametrize("world_size, batch", [(1, 7), (2, 4), (3, 5)])
def test_resume_at_the_same_grid_is_exact_from_any_step(world_size, batch):
    """Saved after any step (epoch ends and dropped tails included) and resumed alike: the same batches."""
    n = 61
    straight = samplers(n, batch, world_size, seed=2)
    stream = [global_batch(straight) for _ in range(4 * straight[0].steps_per_epoch)]
    steps, g = straight[0].steps_per_epoch, batch * world_size
    for i, got in enumerate(stream):  # the grid of a fresh run: batch k of an epoch is perm[k*G:(k+1)*G]
        assert np.array_equal(got, straight[0].epoch_order(i // steps)[i % steps * g:(i % steps + 1) * g])
    for stop in range(len(stream) - straight[0].steps_per_epoch):
        state = advance(samplers(n, batch, world_size, seed=2), stop)
        resumed = samplers(n, batch, world_size, seed=2)
        for s in resumed:
            s.load_state_dict(state)
        for expected in stream[stop:stop + straight[0].steps_per_epoch]:
            assert np.array_equal(global_batch(resumed), expected)


def test_resume_with_less_than_a_batch_left_starts_the_next_epoch():
    state = {"epoch": 4, "samples_consumed_in_epoch": 90, "seed": 1}  # 10 left of 100
    (sampler,) = samplers(100, 16, 1)
    sampler.load_state_dict(state)
    assert sampler.state_dict() == {"epoch": 5, "samples_consumed_in_epoch": 0, "seed": 1}
    assert np.array_equal(sampler.next_indices(), sampler.epoch_order(5)[:16]) and sampler.epoch == 5
    exact_end = samplers(100, 16, 1)[0]
    exact_end.load_state_dict({**state, "samples_consumed_in_epoch": 100})
    assert np.array_equal(exact_end.next_indices(), sampler.epoch_order(5)[:16])


def test_resume_rejects_a_bad_state():
    sampler = GlobalBatchSampler(64, 16, rank=0, world_size=1)
    with pytest.raises(ValueError, match="lacks"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="non-negative integers"):
        sampler.load_state_dict({"epoch": 0, "samples_consumed_in_epoch": -8, "seed": 0})
    with pytest.raises(ValueError, match="has only 10 here"):
        GlobalBatchSampler(10, 2, rank=0, world_size=1).load_state_dict(
            {"epoch": 1, "samples_consumed_in_epoch": 16, "seed": 0})


def test_finished_epoch_is_saved_as_the_next_one():
    ranks = samplers(20, 3, 2, seed=1)  # 3 steps of 6, 2 samples dropped
    for _ in range(3):
        global_batch(ranks)
    assert ranks[0].epoch == 0
    state = ranks[0].state_dict()
    assert state == {"epoch": 1, "samples_consumed_in_epoch": 0, "seed": 1}
    resumed = samplers(20, 7, 1)  # a global batch of 7 could not resume at 18 samples, but can at 0
    resumed[0].load_state_dict(state)
    assert np.array_equal(resumed[0].next_indices(), ranks[0].epoch_order(1)[:7])


def test_sampler_rejects_bad_arguments():
    with pytest.raises(DatasetError, match=r"10 samples.*batch size 4 x world size 3"):
        GlobalBatchSampler(10, 4, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank"):
        GlobalBatchSampler(10, 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed"):
        GlobalBatchSampler(10, 1, rank=0, world_size=1, seed=-1)
    with pytest.raises(ValueError, match="batch_size"):
        GlobalBatchSampler(10, 0, rank=0, world_size=1)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_eval_indices_shard_every_sample_once(size):
    for n in range(0, 14):
        shards = [eval_indices(n, rank, size) for rank in range(size)]
        assert np.array_equal(np.concatenate(shards), np.arange(n))
        lengths = [len(s) for s in shards]
        assert max(lengths) - min(lengths) <= 1


# ---------------------------------------------------------------------------
# generation


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "images.h5"
    return generate_images(path, num_train=2000, num_eval=400, shape=(3, 16, 16), seed=0)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.h5"
    return generate_tokens(path, num_train=400, num_eval=100, seq_len=32, vocab_size=64, seed=0)


def load(path, split):
    with h5py.File(path, "r") as f:
        return f[split]["inputs"][()], f[split]["targets"][()]


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
        assert all(np.array_equal(a, b) for a, b in zip(load(tokens, split), load(again, split)))
        assert not np.array_equal(load(tokens, split)[0], load(other, split)[0])
    a = generate_images(tmp_path / "a.h5", num_train=64, num_eval=16, shape=(2, 8, 8), seed=2)
    b = generate_images(tmp_path / "b.h5", num_train=64, num_eval=16, shape=(2, 8, 8), seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(load(a, "train"), load(b, "train")))


def test_images_are_learnable_but_not_trivial(images):
    x, y = load(images, "train")
    xe, ye = load(images, "eval")
    assert 0.8 < x.std() < 1.2 and abs(x.mean()) < 0.1
    assert np.bincount(y, minlength=10).min() > 100
    means = np.stack([x[y == k].mean(axis=0) for k in range(10)])
    distances = ((xe[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
    accuracy = (distances.argmin(axis=1) == ye).mean()
    assert 0.3 < accuracy < 0.99, accuracy  # chance is 0.1


def test_tokens_are_learnable(tokens):
    x, y = load(tokens, "train")
    xe, ye = load(tokens, "eval")
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
# reading


def test_read_keeps_the_given_order(images):
    x, y = load(images, "train")
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


def write_file(path, *, kind="image", n=8, attrs=None, drop=(), **arrays):
    """A small valid dataset file, with overrides to break it."""
    if kind == "image":
        x = np.zeros((n, 1, 2, 2), np.float32)
        y = np.arange(n) % 3
    else:
        x = np.arange(n * 4).reshape(n, 4) % 5
        y = (x + 1) % 5
    with h5py.File(path, "w") as f:
        f.attrs.update({"hpcnet_format": 1, "kind": kind, "num_classes": 3 if kind == "image" else 5,
                        **(attrs or {})})
        for split in ("train", "eval"):
            for name, value in (("inputs", x), ("targets", y)):
                key = f"{split}/{name}"
                if key not in drop:
                    f.create_dataset(key, data=arrays.get(f"{split}_{name}", value))
        for name in drop:
            if name in f:
                del f[name]
    return path


def break_attr(name):
    def make(path):
        write_file(path)
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
    "format 2": (lambda p: write_file(p, attrs={"hpcnet_format": 2}), "format 1"),
    "bad kind": (lambda p: write_file(p, attrs={"kind": "audio"}), "'audio'"),
    "zero classes": (lambda p: write_file(p, attrs={"num_classes": 0}), "num_classes is 0"),
    "no group": (lambda p: write_file(p, drop=("train",)), "group '/train' is missing"),
    "no inputs": (lambda p: write_file(p, drop=("train/inputs",)), "'/train/inputs' is missing"),
    "no targets": (lambda p: write_file(p, drop=("train/targets",)), "'/train/targets' is missing"),
    "length mismatch": (lambda p: write_file(p, train_targets=np.zeros(7, np.int64)), "8 rows but"),
    "int images": (lambda p: write_file(p, train_inputs=np.zeros((8, 1, 2, 2), np.int32)), "floating point"),
    "float targets": (lambda p: write_file(p, train_targets=np.zeros(8, np.float32)), "must be integers"),
    "2-d image targets": (lambda p: write_file(p, train_targets=np.zeros((8, 2), np.int64)), "must be [N]"),
    "float tokens": (lambda p: write_file(p, kind="tokens", train_inputs=np.zeros((8, 4))), "must be integers"),
    "token shapes": (lambda p: write_file(p, kind="tokens", train_targets=np.zeros((8, 3), np.int64)),
                     "shape of the inputs"),
    "target too big": (lambda p: write_file(p, train_targets=np.full(8, 3)), "holds 3"),
    "negative target": (lambda p: write_file(p, train_targets=np.array([0] * 7 + [-1])), "holds -1"),
    "token out of range": (lambda p: write_file(p, kind="tokens", train_inputs=np.full((8, 4), 9)), "holds 9"),
    "empty": (lambda p: write_file(p, n=0), "is empty"),
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
    path = write_file(tmp_path / "late.h5", n=300_000, train_targets=targets)
    split = open_split(path, "train")
    split.read(np.array([1, 2]))
    with pytest.raises(DatasetError, match="late.h5.*holds 7"):
        split.read(np.array([149_999, 150_000]))


# ---------------------------------------------------------------------------
# user datasets (one process; COMM_SELF)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=10, kind="image", **attrs):
        self.n, self.kind = n, kind
        self.__dict__.update(attrs)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.kind == "image":
            return torch.full((2, 3), float(i)), i % 4
        return torch.arange(5) + i, torch.arange(5) + i + 1


def pairs_factory(split, **options):
    return Pairs(**options)


def protocol_factory(split, *, rows=6):
    class Protocol:
        info = DatasetInfo("tokens", (3,), 10)

        def __len__(self):
            return rows

        def read(self, indices):
            x = torch.as_tensor(np.asarray(indices)).view(-1, 1).repeat(1, 3) % 10
            return x, (x + 1) % 10
    return Protocol()


def bad_protocol_factory(split):
    split = protocol_factory(split)
    split.info = DatasetInfo("tokens", (4,), 10)  # disagrees with what read returns
    return split


def failing_factory(split):
    raise RuntimeError("no such bucket")


def junk_factory(split):
    return 42


def test_map_style_dataset_is_adapted():
    split = open_dataset(f"{__name__}:pairs_factory", "train", directory=".", comm=MPI.COMM_SELF, options={"n": 10})
    assert isinstance(split, TorchDatasetSplit)
    assert split.info == DatasetInfo("image", (2, 3), 4) and len(split) == 10
    inputs, targets = split.read(np.array([3, 1]))
    assert inputs.dtype == torch.float32 and inputs[:, 0, 0].tolist() == [3.0, 1.0]
    assert targets.tolist() == [3, 1]
    tokens = open_dataset(f"{__name__}:pairs_factory", "eval", directory=".", comm=MPI.COMM_SELF,
                          options={"kind": "tokens", "vocab_size": 100})
    assert tokens.info == DatasetInfo("tokens", (5,), 100)
    scanned = TorchDatasetSplit(Pairs(kind="tokens"), "x")
    assert scanned.info.num_classes == 15  # largest token (9 + 5) + 1
    override = TorchDatasetSplit(Pairs(info=DatasetInfo("image", (2, 3), 50)), "x")
    assert override.info.num_classes == 50


def test_protocol_object_is_used_as_is():
    split = open_dataset(f"{__name__}:protocol_factory", "train", directory=".", comm=MPI.COMM_SELF, options={})
    assert split.info.kind == "tokens" and len(split) == 6


@pytest.mark.parametrize(("factory", "fragment"), [
    ("failing_factory", "RuntimeError: no such bucket"),
    ("junk_factory", "returned a int"),
    ("bad_protocol_factory", "read([0]) gave inputs"),
])
def test_user_dataset_errors_name_the_option(factory, fragment):
    with pytest.raises(DatasetError, match="data.dataset") as error:
        open_dataset(f"{__name__}:{factory}", "train", directory=".", comm=MPI.COMM_SELF, options={})
    assert fragment in str(error.value)


def test_bad_specs(tmp_path):
    with pytest.raises(ConfigError, match="data.dataset"):
        open_dataset("no_such_module_xyz:fn", "train", directory=".", comm=MPI.COMM_SELF)
    with pytest.raises(DatasetError, match="data.dataset: file .*nothing.h5 does not exist"):
        open_dataset(str(tmp_path / "nothing.h5"), "train", directory=".", comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="split"):
        open_dataset("synthetic-images", "test", directory=".", comm=MPI.COMM_SELF)
    path = write_file(tmp_path / "ok.h5")
    assert isinstance(open_dataset(str(path), "eval", directory=".", comm=MPI.COMM_SELF), H5Split)


# ---------------------------------------------------------------------------
# prefetching


def test_loader_yields_what_direct_reads_yield(tokens):
    split = open_split(tokens, "train")
    direct = GlobalBatchSampler(len(split), 16, rank=0, world_size=2, seed=3)
    for prefetch in (True, False):
        sampler = GlobalBatchSampler(len(split), 16, rank=0, world_size=2, seed=3)
        direct.load_state_dict({"epoch": 0, "samples_consumed_in_epoch": 0, "seed": 3})
        with BatchLoader(split, sampler, prefetch=prefetch) as loader:
            for step in range(30):  # 12 steps per epoch: crosses two epoch boundaries
                inputs, targets = next(loader)
                expected = split.read(direct.next_indices())
                assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])
                # What the caller consumed, not what the thread has already fetched.
                assert loader.state_dict() == direct.state_dict()
                assert loader.epoch == step // 12


def test_loader_resumes_from_its_state(tokens):
    split = open_split(tokens, "train")
    loader = BatchLoader(split, GlobalBatchSampler(len(split), 10, rank=0, world_size=1, seed=1))
    for _ in range(5):
        loader.next()
    state = loader.state_dict()
    following = [loader.next() for _ in range(3)]
    loader.load_state_dict(state)
    again = [loader.next() for _ in range(3)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(following, again))
    loader.close()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        loader.next()


class FailingSplit:
    info = DatasetInfo("tokens", (2,), 10)

    def __init__(self, fail_at):
        self.calls, self.fail_at, self.threads = 0, fail_at, set()

    def __len__(self):
        return 100

    def read(self, indices):
        self.threads.add(threading.get_ident())
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError("disk went away")
        return torch.zeros(len(indices), 2, dtype=torch.int64), torch.zeros(len(indices), 2, dtype=torch.int64)


def test_loader_reraises_a_read_error_in_the_caller():
    split = FailingSplit(fail_at=3)
    loader = BatchLoader(split, GlobalBatchSampler(100, 4, rank=0, world_size=1))
    loader.next()
    loader.next()
    with pytest.raises(OSError, match="disk went away"):
        loader.next()
    with pytest.raises(RuntimeError, match="failed earlier"):
        loader.next()
    loader.close()
    assert threading.get_ident() not in split.threads  # the reads ran in the background thread


# ---------------------------------------------------------------------------
# collective: any number of ranks


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


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_bad_file_fails_alike_on_every_rank(comm, mpi_tmp_path):
    path = mpi_tmp_path / "shared-bad.h5"
    if comm.Get_rank() == 0:
        write_file(path, attrs={"num_classes": 2})  # image targets go up to 2
    comm.Barrier()
    with pytest.raises(DatasetError) as error:
        open_dataset(str(path), "train", directory=mpi_tmp_path, comm=comm)
    message = str(error.value)
    assert "shared-bad.h5" in message and comm.allgather(message) == [message] * comm.Get_size()


def rank_failing_factory(split):
    world = MPI.COMM_WORLD
    if world.Get_rank() == world.Get_size() - 1:
        raise RuntimeError("only the last rank fails")
    return Pairs()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_failure_on_one_rank_is_raised_on_all(comm):
    with pytest.raises(DatasetError) as error:
        open_dataset(f"{__name__}:rank_failing_factory", "train", directory=".", comm=comm)
    message = str(error.value)
    assert "data.dataset" in message and "only the last rank fails" in message
    assert comm.allgather(message) == [message] * comm.Get_size()
    assert ("only)" in message) == (comm.Get_size() > 1)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_ranks_read_slices_of_one_global_batch(comm, mpi_tmp_path):
    path = mpi_tmp_path / "shared-ok.h5"
    if comm.Get_rank() == 0:
        write_file(path, n=64)
    comm.Barrier()
    split = open_dataset(str(path), "train", directory=mpi_tmp_path, comm=comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    sampler = GlobalBatchSampler(len(split), 2, rank=rank, world_size=size, seed=9)
    single = GlobalBatchSampler(len(split), 2 * size, rank=0, world_size=1, seed=9)
    with BatchLoader(split, sampler) as loader:
        for _ in range(5):
            _, targets = loader.next()
            gathered = np.concatenate(comm.allgather(targets.numpy()))
            assert np.array_equal(gathered, split.read(single.next_indices())[1].numpy())
    assert os.path.exists(path)
