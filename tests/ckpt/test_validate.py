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
from tests.helpers.launch import clean_env

pytestmark = pytest.mark.timeout(120)


def _checkpoint_file(directory):
    with CheckpointManager(MPI.COMM_SELF, directory, full_every=1, async_save=False) as manager:
        return manager.save(1, {"model/w": torch.ones(8, 256), "model/b": torch.ones(4)}, {}, {})


def _rewrite_index(path, edit):
    """Change a checkpoint's /index and fix up its checksum, as someone crafting a file would."""
    from hpcnet.ckpt.schema import sha256_hex

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


def _pieces_file(directory):
    """Two checkpoints of a parameter's state cut in row pieces (as ``dist.zero`` saves it); the second's path."""
    tensors = {"model/w": torch.ones(64, 4), "optim/0/exp_avg:0-32": torch.zeros(32, 4),
               "optim/0/exp_avg:32-64": torch.ones(32, 4)}
    with CheckpointManager(MPI.COMM_SELF, directory, full_every=1, async_save=False) as manager:
        manager.save(1, tensors, {}, {})
        return manager.save(2, tensors, {}, {})


def _rename(renames):
    def edit(f, index):
        for old, new in renames:
            next(e for e in index if e["name"] == old)["name"] = new
            f.move(f"tensors/{old}", f"tensors/{new}")
    return edit


@pytest.mark.parametrize("renames, expected", [
    ([(":0-32", ":0-40"), (":32-64", ":40-64")],
     "'optim/0/exp_avg:0-40': shape [32, 4] does not hold the rows 0 to 40"),
    ([(":32-64", ":33-65")], "the row pieces of 'optim/0/exp_avg' leave out rows at 32 to 33"),
    ([(":32-64", ":16-48")], "the row pieces of 'optim/0/exp_avg' repeat rows at 16 to 32"),
    ([(":32-64", "")], "'optim/0/exp_avg' is stored both whole and in row pieces"),
])
def test_row_pieces_whose_names_do_not_match_their_rows_are_damage(single_process, tmp_path, renames, expected):
    """Issue 27, item 7: names are what a reader joins the pieces by, so pieces that do not make the rows their
    names say fail verification, and a load takes the checkpoint before."""
    from hpcnet.ckpt.load import load_checkpoint
    from hpcnet.ckpt.tool import main as ckpt_main

    path = _pieces_file(tmp_path / "pieces")
    _rewrite_index(path, _rename([(f"optim/0/exp_avg{a}", f"optim/0/exp_avg{b}") for a, b in renames]))
    out = io.StringIO()
    assert ckpt_main(["verify", str(tmp_path / "pieces")], out=out) == 1
    assert f"FAILED {path.name}" in out.getvalue() and expected in out.getvalue(), out.getvalue()
    assert "ok     ckpt-0000000001.h5" in out.getvalue()
    loaded = load_checkpoint(MPI.COMM_SELF, "auto", tmp_path / "pieces")
    assert loaded.step == 1 and len(loaded.skipped) == 1 and expected in loaded.skipped[0]


@pytest.mark.parametrize("table", ["rank_state", "rank_state_hashes", "hashes"])
def test_a_table_that_is_a_group_is_damage_not_a_crash(single_process, tmp_path, table):
    """Issue 27, item 11: a /rank_state that is a group made verify fail with an AttributeError (and a resume
    with status 1); every table is checked with the header, and a load takes the checkpoint before."""
    from hpcnet.ckpt.load import load_checkpoint
    from hpcnet.ckpt.tool import main as ckpt_main

    path = _pieces_file(tmp_path / "group")
    with h5py.File(path, "r+") as f:
        del f[table]
        f.create_group(table)
    out = io.StringIO()
    assert ckpt_main(["verify", str(tmp_path / "group")], out=out) == 1
    assert f"FAILED {path.name}" in out.getvalue() and f"dataset /{table}: " in out.getvalue(), out.getvalue()
    loaded = load_checkpoint(MPI.COMM_SELF, "auto", tmp_path / "group")
    assert loaded.step == 1 and f"dataset /{table}" in loaded.skipped[0]
