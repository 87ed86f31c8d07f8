"""A full disk in a save, for real, through ``python -m hpcnet.train``: status 2 on every rank, never a crash in
HDF5 (status 139, which supervisors restart), and the previous checkpoint stays ``latest`` and loads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcnet.errors import ExitCode
from tests.helpers.data import tiny_images
from tests.helpers.launch import clean_env

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a tmpfs of the given size at ``tmp_path/fs`` (skipped where mounting is refused); unmounted after."""
    mount = tmp_path / "fs"
    mount.mkdir()
    mounted = []

    def _mount(size: str, remount: bool = False) -> Path:
        options = f"remount,size={size}" if remount else f"size={size}"
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True,
                             text=True)
        if out.returncode:
            pytest.skip(f"needs a tmpfs mount (root): {out.stderr.strip()}")
        mounted.append(mount)
        return mount

    yield _mount
    if mounted:
        subprocess.run(["umount", str(mount)], check=True)


def _args(tmp_path, fs, *extra):
    dataset = tiny_images(MPI.COMM_SELF, tmp_path, "images.h5", num_train=256, num_eval=16, seed=1)
    return [f"data.dataset={dataset}", f"run.dir={tmp_path / 'runs'}", "run.name=x", "model.name=mlp",
            "train.batch_size=8", "train.eval_every=0", "checkpoint.every_s=0", "checkpoint.every_steps=1",
            f"checkpoint.dir={fs / 'ckpt'}", "dist.probe=false", *extra]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _verify(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcnet.ckpt", "verify", str(directory)], env=clean_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.launch
def test_an_increment_that_does_not_fit_stops_with_status_2_not_a_crash(launch, tmp_path, tmpfs):
    """Issue 27's case: an increment fits the free space without its /hashes and /blocks, not with them.

    The free-space check counted only the tensor data, meta, index and 1 MiB,
    so the save ran out of space inside HDF5, and both ranks crashed (139).
    """
    import h5py

    fs = tmpfs("700m")
    # 276 MiB of weights and momentum in 1 KiB blocks: 2 MiB of /hashes, and as much of /blocks in an increment.
    args = _args(tmp_path, fs, "model.options.hidden=[524288]", "checkpoint.full_every=4",
                 "checkpoint.async_save=false")
    first = launch(2, *args, "train.steps=1", timeout=400)
    assert first.returncode == 0, first.stderr
    stat = os.statvfs(fs)
    used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
    with h5py.File(fs / "ckpt" / "ckpt-0000000001.h5", "r") as f:
        old_estimate = sum(f[name].id.get_storage_size() for name in ("meta", "index")) + (1 << 20)
        old_estimate += sum(d.id.get_storage_size() for d in f["tensors/model"].values())
        old_estimate *= 2  # model and optimizer state; the increment at step 2 changes every block
        hashes = f["hashes"].id.get_storage_size()
    subprocess.run(["rm", "-rf", str(fs / "ckpt"), str(tmp_path / "runs")], check=True)
    # Room for the same first checkpoint, then for the increment as the old check counted it, and for half of
    # its /hashes and /blocks: the old check let it start, and it ran out inside the write.
    tmpfs(f"{(used + old_estimate + hashes) // 4096 * 4096}", remount=True)
    out = launch(2, *args, "train.steps=2", timeout=400)
    assert out.returncode == ExitCode.USAGE_ERROR, out.stderr[-3000:]
    assert re.search(r"ckpt-0000000002\.h5\.[0-9a-f]{16}\.tmp", out.stderr) and "No space left on device" in out.stderr
    assert "MiB needed" in out.stderr
    assert _names(fs / "ckpt") == ["ckpt-0000000001.h5", "latest"]
    assert (fs / "ckpt" / "latest").read_text().strip() == "ckpt-0000000001.h5"
    verified = _verify(fs / "ckpt")
    assert verified.returncode == 0 and "ok     ckpt-0000000001.h5: step 1" in verified.stdout, verified.stdout


@pytest.mark.launch
def test_a_disk_full_to_the_last_byte_in_a_save_stops_every_rank_with_status_2(launch, tmp_path, tmpfs):
    """``fault.write_error=fill``: the disk fills for real before the save allocates its file, so that not even
    HDF5's close of it can write; the job still ends with 2 (not in a crash inside HDF5), nothing is lost, and
    once there is room again the run resumes from the previous checkpoint."""
    from hpcnet.fault.inject import FILL_NAME

    fs = tmpfs("32m")
    args = _args(tmp_path, fs, "model.options.hidden=[32]")
    out = launch(2, *args, "train.steps=3", "fault.write_error=fill", "fault.write_error_at_step=2")
    assert out.returncode == ExitCode.USAGE_ERROR, out.stderr[-3000:]
    assert re.search(r"ckpt-0000000002\.h5\.[0-9a-f]{16}\.tmp", out.stderr) and "No space left on device" in out.stderr
    assert "Segmentation fault" not in out.stderr
    assert _names(fs / "ckpt") == ["ckpt-0000000001.h5", FILL_NAME, "latest"]
    assert (fs / "ckpt" / "latest").read_text().strip() == "ckpt-0000000001.h5"
    (fs / "ckpt" / FILL_NAME).unlink()
    again = launch(2, *args, "train.steps=3", "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ckpt-0000000001.h5 at step 1" in again.stderr
