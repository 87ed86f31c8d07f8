"""hpcnet.ckpt.listing: a directory's committed checkpoints in commit order, ``latest``, and setting aside."""

import pytest
import torch
from mpi4py import MPI

from hpcnet.ckpt.listing import listing, read_info, scan, set_aside, write_latest
from hpcnet.ckpt.manager import CheckpointManager
from tests.helpers.ckpt import checkpoint_names

pytestmark = pytest.mark.timeout(120)


def _saved(directory, steps):
    with CheckpointManager(MPI.COMM_SELF, directory, keep=10, full_every=1, async_save=False) as manager:
        for step in steps:
            manager.save(step, {"model/w": torch.full((4, 256), float(step))}, {}, {})


def test_scan_goes_by_commit_order_and_finds_what_did_not_finish(single_process, tmp_path):
    _saved(tmp_path, [30, 10])  # a rollback: 10 was committed after 30
    (tmp_path / "ckpt-0000000040.h5.tmp").write_bytes(b"half")
    (tmp_path / "ckpt-0000000050.h5").write_text("not HDF5")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    infos, stale = scan(tmp_path)
    # an unreadable file's order is unknown: last, so a resume tries (and sets aside) it first
    assert [(i.step, i.kind) for i in infos] == [(30, "full"), (10, "full"), (50, "unreadable")]
    assert [i.seq for i in infos[:2]] == [1, 2] and "OSError" in infos[2].error
    assert [p.name for p in stale] == ["ckpt-0000000040.h5.tmp"]
    assert scan(tmp_path / "missing") == ([], [])
    assert read_info(tmp_path / "ckpt-0000000030.h5") == infos[0]


def test_a_checkpoint_deleted_while_the_directory_is_scanned_is_not_listed(single_process, tmp_path, monkeypatch):
    """A run that saves into the directory prunes files between the scan's listing and its opening them: gone, not
    'unreadable' (which a resume would set aside and the tool would show as damaged)."""
    from hpcnet.ckpt import listing as listing_module

    _saved(tmp_path, [1, 2])
    real = listing_module.open_read

    def open_read(path):
        if path.name == "ckpt-0000000001.h5":
            path.unlink()
        return real(path)
    monkeypatch.setattr(listing_module, "open_read", open_read)
    infos, _ = scan(tmp_path)
    assert [(i.step, i.kind) for i in infos] == [(2, "full")]


def test_listing_is_names_and_sizes_without_opening_files(single_process, tmp_path):
    _saved(tmp_path, [1])
    (tmp_path / "ckpt-0000000002.h5").write_text("x" * 7)
    names = listing(tmp_path)
    assert [n for n, _ in names] == ["ckpt-0000000001.h5", "ckpt-0000000002.h5"] and names[1][1] == 7
    assert names[0][1] == (tmp_path / "ckpt-0000000001.h5").stat().st_size
    assert listing(tmp_path / "missing") == []


def test_set_aside_moves_whole_checkpoints_and_repoints_latest(single_process, tmp_path):
    _saved(tmp_path, [1, 2, 3])
    infos, _ = scan(tmp_path)
    first = set_aside(tmp_path, infos[1:], "rollback-to-step-1", latest="ckpt-0000000001.h5")
    assert checkpoint_names(tmp_path) == ["ckpt-0000000001.h5"]
    assert sorted(p.name for p in first.glob("ckpt-*")) == ["ckpt-0000000002.h5", "ckpt-0000000003.h5"]
    assert first.name.startswith("aside-") and first.name.endswith("-rollback-to-step-1")
    assert "2 checkpoint(s)" in (first / "README.txt").read_text()
    assert (tmp_path / "latest").read_text() == "ckpt-0000000001.h5\n"
    second = set_aside(tmp_path, scan(tmp_path)[0], "rollback-to-step-1", latest=None)
    assert second != first and checkpoint_names(tmp_path) == [] and not (tmp_path / "latest").exists()
    assert (second / "latest").read_text() == "ckpt-0000000001.h5\n"
    assert read_info(second / "ckpt-0000000001.h5").kind == "full"  # moved whole, still loadable


def test_write_latest_replaces_it_atomically(tmp_path):
    write_latest(tmp_path, "ckpt-0000000001.h5")
    write_latest(tmp_path, "ckpt-0000000002.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert (tmp_path / "latest").read_text() == "ckpt-0000000002.h5\n"
