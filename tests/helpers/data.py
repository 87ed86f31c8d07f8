"""Small dataset files for the tests."""

from pathlib import Path


def tiny_images(comm, directory: Path, name: str, *, num_train: int, num_eval: int, seed: int) -> Path:
    """A small 4-class 1x8x8 image set shared by the ranks of ``comm``: rank 0 writes it once (collective)."""
    from hpcnet.data.synthetic import generate_images

    path = directory / name
    if comm.Get_rank() == 0 and not path.exists():
        generate_images(path, num_train=num_train, num_eval=num_eval, shape=(1, 8, 8), num_classes=4, seed=seed)
    comm.Barrier()
    return path


def tiny_tokens(comm, directory: Path, name: str, *, num_train: int, num_eval: int, seq_len: int, vocab_size: int,
                seed: int) -> Path:
    """A small token set shared by the ranks of ``comm``: rank 0 writes it once (collective)."""
    from hpcnet.data.synthetic import generate_tokens

    path = directory / name
    if comm.Get_rank() == 0 and not path.exists():
        generate_tokens(path, num_train=num_train, num_eval=num_eval, seq_len=seq_len, vocab_size=vocab_size,
                        seed=seed)
    comm.Barrier()
    return path


def write_dataset(path: Path, *, kind: str = "image", n: int = 8, attrs=None, drop=(), **arrays) -> Path:
    """A small valid hpcnet dataset file, with overrides to break it (``train_targets=...``, ``drop=("train",)``)."""
    import h5py
    import numpy as np

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


def load_split(path: Path, split: str):
    """All of ``/<split>/inputs`` and ``/<split>/targets`` of a dataset file, as numpy arrays."""
    import h5py

    with h5py.File(path, "r") as f:
        return f[split]["inputs"][()], f[split]["targets"][()]


def shared_data_dir(tmp_path: Path) -> Path:
    """A ``data.dir`` shared by the tests of one pytest process (beside their ``tmp_path``s, in pytest's session
    folder: one a worker of the serial pass), so that a built-in synthetic dataset (8192 images, 2-3 s on rank 0)
    is generated once a process instead of once a test. For jobs that a test starts on one host; files appear by
    an atomic rename, so a job never reads another's half-written file."""
    path = tmp_path.parent / "shared-data"
    path.mkdir(exist_ok=True)
    return path
