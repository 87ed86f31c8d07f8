"""Synthetic datasets: learnable image and token sets written as hpcnet HDF5 files.

Images: each class has a fixed random smooth prototype; a sample is the
prototype scaled, shifted and covered in noise, so a small model's loss falls
within a few hundred steps without reaching 100% at once.  Tokens: sequences
from a random sparse Markov chain, so next-token loss falls well below
log(vocabulary).  Files are written to a temporary name, fsynced and renamed.

    python -m hpcnet.data generate images --out data/my.h5 [--num-train N ...]
"""

import argparse
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcnet.agree import agree_on_error, mark_agreed
from hpcnet.data.cli import run_commands
from hpcnet.data.h5 import atomic_h5, create_split, set_root_attributes
from hpcnet.data.info import SPLITS, positive_ints
from hpcnet.errors import DatasetError

SYNTHETIC_DATASETS = ("synthetic-images", "synthetic-tokens")
CHUNK_BYTES = 1 << 20
"""Target size of one HDF5 chunk: big enough for fast scans, small enough that a random row is cheap."""

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# generation (serial, one process)


def _interpolation_matrix(size_out: int, size_in: int) -> np.ndarray:
    # Linear interpolation as a matrix, so upsampling a batch is one einsum.
    position = np.linspace(0, size_in - 1, size_out)
    low = np.floor(position).astype(np.int64)
    frac = position - low
    matrix = np.zeros((size_out, size_in))
    matrix[np.arange(size_out), low] += 1 - frac
    matrix[np.arange(size_out), np.minimum(low + 1, size_in - 1)] += frac
    return matrix


def _smooth_patterns(rng: np.random.Generator, count: int, channels: int, height: int, width: int) -> np.ndarray:
    # A 4x4 random grid upsampled: smooth, so small shifts keep a pattern recognisable.
    low = rng.standard_normal((count, channels, 4, 4))
    patterns = np.einsum("hi,ncij,wj->nchw", _interpolation_matrix(height, 4), low, _interpolation_matrix(width, 4))
    patterns -= patterns.mean(axis=(1, 2, 3), keepdims=True)
    patterns /= patterns.std(axis=(1, 2, 3), keepdims=True)
    return patterns


def generate_images(path: str | os.PathLike[str], *, num_train: int = 8192, num_eval: int = 1024,
                    shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, noise: float = 1.0,
                    seed: int = 0) -> Path:
    """Write a learnable synthetic image classification set.

    Each class has a smooth random prototype. A sample is its class prototype
    at a random scale and shift, plus a random mix of smooth "nuisance"
    patterns shared by all classes and white noise. A linear model or a small
    ResNet learns it within a few hundred steps, but not at once.

    Args:
        path: the file to write (replaced atomically).
        num_train: training samples.
        num_eval: evaluation samples.
        shape: per-sample (C, H, W).
        num_classes: number of classes.
        noise: scale of the nuisance and white noise relative to the default; larger is harder.
        seed: everything is a function of this seed.
    """
    positive_ints(num_train=num_train, num_eval=num_eval, num_classes=num_classes)
    if len(shape) != 3:
        raise ValueError(f"shape must be (C, H, W), got {shape!r}")
    positive_ints(channels=shape[0], height=shape[1], width=shape[2])
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    channels, height, width = shape
    shift = max(1, min(height, width) // 10)
    rng = np.random.default_rng([seed, 0])
    # Patterns are drawn larger than the image and cropped at a random offset: the shift.
    prototypes = _smooth_patterns(rng, num_classes, channels, height + 2 * shift, width + 2 * shift)
    nuisance = _smooth_patterns(rng, 16, channels, height + 2 * shift, width + 2 * shift)
    signal = 0.5  # prototype amplitude against unit-variance nuisance and white noise; tuned by hand
    # Divide by the expected pixel std so inputs are roughly standardised (E[scale^2] = 13/12).
    norm = math.sqrt(signal**2 * 13 / 12 + 2 * noise**2) or 1.0
    path = Path(path)
    with atomic_h5(path) as f:
        set_root_attributes(f, "image", num_classes, generator="hpcnet.data.generate_images", seed=seed,
                            noise=noise)
        for split_id, (split, count) in enumerate((("train", num_train), ("eval", num_eval)), start=1):
            inputs, targets = create_split(f, split, ((count, *shape), "float32"), ((count,), "int64"),
                                           chunk_bytes=CHUNK_BYTES)
            split_rng = np.random.default_rng([seed, split_id])
            for lo in range(0, count, 1024):
                n = min(1024, count - lo)
                labels = split_rng.integers(0, num_classes, n)
                scale = split_rng.uniform(0.5, 1.5, n)
                mix = split_rng.standard_normal((n, len(nuisance))) / math.sqrt(len(nuisance))
                big = (signal * scale[:, None, None, None] * prototypes[labels]
                       + noise * np.einsum("nk,kchw->nchw", mix, nuisance))
                rows = split_rng.integers(0, 2 * shift + 1, n)[:, None] + np.arange(height)
                cols = split_rng.integers(0, 2 * shift + 1, n)[:, None] + np.arange(width)
                crop = big[np.arange(n)[:, None, None, None], np.arange(channels)[None, :, None, None],
                           rows[:, None, :, None], cols[:, None, None, :]]
                crop += noise * split_rng.standard_normal(crop.shape)
                inputs[lo:lo + n] = (crop / norm).astype(np.float32)
                targets[lo:lo + n] = labels
    return path


def generate_tokens(path: str | os.PathLike[str], *, num_train: int = 4096, num_eval: int = 512,
                    seq_len: int = 64, vocab_size: int = 256, seed: int = 0) -> Path:
    """Write a learnable synthetic next-token set drawn from a sparse Markov chain.

    Every token has 4 possible successors with random probabilities, and 5% of
    steps pick a uniform random token, so the best loss is near 1.3 nats,
    well below log(vocab_size). Targets are the inputs shifted by one.

    Args:
        path: the file to write (replaced atomically).
        num_train: training sequences.
        num_eval: evaluation sequences.
        seq_len: tokens per sequence.
        vocab_size: vocabulary size (``num_classes``).
        seed: everything is a function of this seed.
    """
    positive_ints(num_train=num_train, num_eval=num_eval, seq_len=seq_len, vocab_size=vocab_size)
    rng = np.random.default_rng([seed, 0])
    successors = rng.integers(0, vocab_size, (vocab_size, 4))
    cumulative = np.cumsum(rng.dirichlet(np.full(4, 0.5), size=vocab_size), axis=1)
    path = Path(path)
    with atomic_h5(path) as f:
        set_root_attributes(f, "tokens", vocab_size, generator="hpcnet.data.generate_tokens", seed=seed)
        for split_id, (split, count) in enumerate((("train", num_train), ("eval", num_eval)), start=1):
            shape = (count, seq_len)
            inputs, targets = create_split(f, split, (shape, "int64"), (shape, "int64"), chunk_bytes=CHUNK_BYTES)
            split_rng = np.random.default_rng([seed, split_id])
            for lo in range(0, count, 4096):
                n = min(4096, count - lo)
                sequence = np.empty((n, seq_len + 1), dtype=np.int64)
                sequence[:, 0] = split_rng.integers(0, vocab_size, n)
                for t in range(seq_len):
                    current = sequence[:, t]
                    choice = (split_rng.random(n)[:, None] > cumulative[current]).sum(axis=1).clip(max=3)
                    following = successors[current, choice]
                    uniform = split_rng.random(n) < 0.05
                    following[uniform] = split_rng.integers(0, vocab_size, int(uniform.sum()))
                    sequence[:, t + 1] = following
                inputs[lo:lo + n] = sequence[:, :-1]
                targets[lo:lo + n] = sequence[:, 1:]
    return path


def synthetic_path(name: str, directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """Where ``ensure_synthetic`` keeps a built-in dataset: ``<directory>/<name>.h5``.

    Args:
        name: ``"synthetic-images"`` or ``"synthetic-tokens"``.
        directory: the cache directory (``data.dir``).
        seed: a nonzero seed gets its own file, ``<name>-seed<seed>.h5``, so it never reuses another seed's data.
    """
    return Path(directory) / (f"{name}.h5" if seed == 0 else f"{name}-seed{seed}.h5")


def ensure_synthetic(name: str, directory: str | os.PathLike[str], *, comm: Any, seed: int = 0) -> Path:
    """Return the path of a built-in synthetic dataset, generating it on rank 0 if missing (collective).

    Args:
        name: ``"synthetic-images"`` or ``"synthetic-tokens"``.
        directory: the cache directory; it must be visible to every rank.
        comm: the communicator whose ranks will read the file.
        seed: generation seed (see ``synthetic_path``).

    Raises:
        DatasetError: on every rank alike, when rank 0 cannot write the file or some rank cannot see it.
    """
    if name not in SYNTHETIC_DATASETS:
        raise DatasetError(f"data.dataset: {name!r} is not a built-in dataset ({', '.join(SYNTHETIC_DATASETS)})")
    path = synthetic_path(name, directory, seed)
    error: DatasetError | None = None
    if comm.Get_rank() == 0 and not path.is_file():
        try:
            generate = generate_images if name == "synthetic-images" else generate_tokens
            # Rank 0 writes while the others wait in the agreement below: say so, it may take a while.
            log.info("generating the %s dataset once into %s (the other ranks wait; later runs reuse it)", name, path)
            t0 = time.perf_counter()
            generate(path, seed=seed)
            log.info("generated %s in %.1f s", path.name, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - shared below, so no rank is left waiting
            error = DatasetError(f"cannot create the synthetic dataset {path}: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
    # The agreement is also the barrier: the others cannot pass it before rank 0 has finished writing.
    agree_on_error(comm, error)
    missing = [rank for rank, seen in enumerate(comm.allgather(path.is_file())) if not seen]
    if missing:
        raise mark_agreed(DatasetError(f"{path} was written by rank 0 but ranks {missing} cannot see it: "
                                  "data.dir must be a directory shared by every node"))
    return path


# ---------------------------------------------------------------------------
# command line


def add_generate_command(commands: Any) -> None:
    """Add ``generate`` to the subcommands of a ``python -m hpcnet.data`` parser.

    Args:
        commands: what ``ArgumentParser.add_subparsers`` returned.
    """
    gen = commands.add_parser("generate", help="write a synthetic dataset file")
    gen.add_argument("kind", choices=("images", "tokens"))
    gen.add_argument("--out", required=True, type=Path, help="the .h5 file to write")
    gen.add_argument("--num-train", type=int, help="training samples")
    gen.add_argument("--num-eval", type=int, help="evaluation samples")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--shape", type=int, nargs=3, metavar=("C", "H", "W"), help="images: sample shape")
    gen.add_argument("--num-classes", type=int, help="images: number of classes")
    gen.add_argument("--noise", type=float, help="images: noise scale (1.0 = default difficulty)")
    gen.add_argument("--seq-len", type=int, help="tokens: sequence length")
    gen.add_argument("--vocab-size", type=int, help="tokens: vocabulary size")
    gen.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    common = {"num_train": args.num_train, "num_eval": args.num_eval}
    only = {"images": {"shape": args.shape, "num_classes": args.num_classes, "noise": args.noise},
            "tokens": {"seq_len": args.seq_len, "vocab_size": args.vocab_size}}
    other = "tokens" if args.kind == "images" else "images"
    wrong = [f"--{k.replace('_', '-')}" for k, v in only[other].items() if v is not None]
    if wrong:
        parser.error(f"{', '.join(wrong)} do(es) not apply to {args.kind}")
    kwargs = {k: v for k, v in {**common, **only[args.kind]}.items() if v is not None}
    if "shape" in kwargs:
        kwargs["shape"] = tuple(kwargs["shape"])
    generate = generate_images if args.kind == "images" else generate_tokens
    try:
        path = generate(args.out, seed=args.seed, **kwargs)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.exit(1, f"cannot write {args.out}: {exc}\n")
    with h5py.File(path, "r") as f:
        sizes = ", ".join(f"{split} inputs {f[split]['inputs'].shape}" for split in SPLITS)
    print(f"wrote {path}: {args.kind}, {sizes}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpcnet.data generate images|tokens --out PATH [options]`` (``data/generate.py``).

    ``python -m hpcnet.data`` itself also has ``convert`` (``hpcnet/data/__main__.py``).

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.
    """
    return run_commands(argv, add_generate_command)
