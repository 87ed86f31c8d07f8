"""hpcnet.ckpt.validate: crafted files are rejected before anything is read or allocated from them."""

import io
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcnet.ckpt.manager import CheckpointManager

from tests.helpers import clean_env

pytestmark = pytest.mark.timeout(120)


def _checkpoint_file(directory):
    with CheckpointManager(MPI.COMM_SELF, directory, full_every=1, async_save=False) as manager:
        return manager.save(1, {"model/w": torch.ones(8, 256), "model/b": torch.ones(4)}, {}, {})


def _rewrite_index(path, edit):
    """Change a checkpoint's /index and fix up its checksum, as someone crafting a file would."""
    from hpcnet.ckpt.format import sha256_hex

    with h5py.File(path, "r+") as f:
        index = json.loads(f["index"][()].tobytes())
        edit(f, index)
        raw = json.dumps(index, separators=(",", ":")).encode()
        del f["index"]
        f["index"] = np.frombuffer(raw, np.uint8)
        f.attrs["index_sha256"] = sha256_hex(raw)


def _run_limited(args, cwd, limit_bytes=3 << 30):
    """A tool run whose address space is capped: allocating what a crafted file declares would fail."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "hpcnet.ckpt", *map(str, args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=120, preexec_fn=cap)


def test_a_file_declaring_a_64_gib_tensor_is_rejected_without_allocating_it(single_process, tmp_path):
    path = _checkpoint_file(tmp_path / "crafted")

    def huge(f, index):
        rows = 64 << 20  # 64 Mi rows of 1 KiB: 64 GiB
        entry = next(e for e in index if e["name"] == "model/w")
        entry["shape"], entry["block_rows"] = [rows, 256], 1  # one block a row, whatever the file's block size
        shift = rows - entry["n_hashes"]
        for later in index[index.index(entry) + 1:]:
            later["hash_offset"] += shift
        entry["n_hashes"] = rows
        del f["tensors/model/w"], f["hashes"]
        f.create_dataset("tensors/model/w", shape=(rows, 256), dtype="<f4")  # declared, never stored
        f.create_dataset("hashes", shape=(sum(e["n_hashes"] for e in index),), dtype="<u8")

    _rewrite_index(path, huge)
    assert os.path.getsize(path) < 1 << 20
    out = _run_limited(["verify", path], tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED" in out.stdout and "declares 68719476752 bytes of tensors" in out.stdout
    assert "MemoryError" not in out.stdout + out.stderr
    out = _run_limited(["export", path, "-o", tmp_path / "x.pt"], tmp_path)
    assert out.returncode == 1 and "declares" in out.stderr and not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("trick", ["external-link", "soft-link", "external-storage", "unstored"])
def test_files_that_read_elsewhere_or_declare_more_than_they_hold_are_rejected(single_process, tmp_path, trick):
    from hpcnet.ckpt.tool import main as ckpt_main

    path = _checkpoint_file(tmp_path / "crafted")
    donor = tmp_path / "donor.h5"
    with h5py.File(donor, "w") as f:
        f["w"] = np.ones((8, 256), np.float32)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.ones((8, 256), np.float32).tobytes())
    with h5py.File(path, "r+") as f:
        offset = f["tensors/model/w"].id.get_offset()
        del f["tensors/model/w"]
        if trick == "external-link":
            f["tensors/model/w"] = h5py.ExternalLink(str(donor), "w")
        elif trick == "soft-link":
            f["elsewhere"] = np.ones((8, 256), np.float32)
            f["tensors/model/w"] = h5py.SoftLink("/elsewhere")
        elif trick == "external-storage":
            f.create_dataset("tensors/model/w", shape=(8, 256), dtype="<f4", external=[(str(raw), 0, 8192)])
        else:
            f.create_dataset("tensors/model/w", shape=(8, 256), dtype="<f4")
    out = io.StringIO()
    assert ckpt_main(["verify", str(path)], out=out) == 1
    expected = {"external-link": "/tensors/model/w is an external link", "soft-link": "/tensors/model/w is a soft link",
                "external-storage": "external", "unstored": "declares 8192 bytes but the file stores 0"}[trick]
    assert expected in out.getvalue(), out.getvalue()
