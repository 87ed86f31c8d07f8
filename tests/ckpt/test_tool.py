"""hpcnet.ckpt.tool: ``python -m hpcnet.ckpt`` list, inspect, verify, export."""

import io
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from mpi4py import MPI

from hpcnet.ckpt.load import load_checkpoint
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.ckpt.state import rng_state
from tests.helpers.ckpt import (
    assert_same_tensors,
    flip_bytes_in,
    model_and_optimizer_state,
    model_and_optimizers,
    train_steps,
)
from tests.helpers.launch import clean_env

pytestmark = pytest.mark.timeout(120)


def _ckpt(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcnet.ckpt", *map(str, args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=60)


def test_ckpt_tool_and_h5ls(single_process, tmp_path, capsys):
    model, sgd, _ = model_and_optimizers()
    train_steps(model, [sgd], 1)
    directory = tmp_path / "ckpts"
    with CheckpointManager(MPI.COMM_SELF, directory, full_every=2, async_save=False) as manager:
        for step in (10, 20):
            entries = model_and_optimizer_state(model, sgd)
            manager.save(step, entries.tensors, entries.meta, rng_state())
            train_steps(model, [sgd], 1)
    out = _ckpt("list", directory, cwd=tmp_path)
    assert out.returncode == 0 and "incremental" in out.stdout and "ckpt-0000000010.h5" in out.stdout
    out = _ckpt("inspect", directory, cwd=tmp_path)
    assert out.returncode == 0 and "model/0.weight" in out.stdout and "bfloat16" in out.stdout
    assert "ckpt-0000000010.h5 -> ckpt-0000000020.h5" in out.stdout
    assert _ckpt("verify", directory, cwd=tmp_path).returncode == 0
    out = _ckpt("export", directory, "-o", tmp_path / "model.pt", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    newest = load_checkpoint(MPI.COMM_SELF, str(directory)).tensors
    assert_same_tensors({f"model/{k}": v for k, v in state.items()},
                        {k: v for k, v in newest.items() if k.startswith("model/")})
    if shutil.which("h5ls"):
        listing = subprocess.run(["h5ls", "-r", directory / "ckpt-0000000010.h5"], capture_output=True, text=True)
        assert listing.returncode == 0 and "/tensors/model/0.weight" in listing.stdout
        assert "Dataset {300, 16}" in listing.stdout
    with h5py.File(directory / "ckpt-0000000010.h5", "r") as f:  # plain serial h5py
        assert f["tensors/model/0.weight"].shape == (300, 16) and f["tensors/model/bf16"].attrs["dtype"] == "bfloat16"
    # the error paths in-process (a subprocess costs seconds of imports)
    from hpcnet.ckpt.tool import main as ckpt_main

    flip_bytes_in(directory / "ckpt-0000000010.h5", "tensors/model/0.weight")
    out = io.StringIO()
    assert ckpt_main(["verify", str(directory)], out=out) == 1
    assert "FAILED ckpt-0000000010.h5" in out.getvalue() and "/tensors/model/0.weight" in out.getvalue()
    assert ckpt_main(["inspect", str(tmp_path / "nowhere")], out=out) == 2
    assert "nowhere" in capsys.readouterr().err


def _saved(directory, steps):
    """Full checkpoints of ``steps`` in ``directory``, each of one model tensor filled with its step."""
    with CheckpointManager(MPI.COMM_SELF, directory, keep=10, full_every=1, async_save=False) as manager:
        for step in steps:
            manager.save(step, {"model/w": torch.full((4, 256), float(step))}, {}, {})


def _pruned_when_opened(monkeypatch, module, names=None):
    """Delete each checkpoint named in ``names`` (None: every one) just before ``module`` opens it, as a run that
    saves into the directory prunes the files the tool listed a moment before."""
    real = module.open_read

    def open_read(path):
        if names is None or Path(path).name in names:
            Path(path).unlink(missing_ok=True)
        return real(path)
    monkeypatch.setattr(module, "open_read", open_read)


def _run(*args):
    from hpcnet.ckpt.tool import main as ckpt_main

    out = io.StringIO()
    return ckpt_main(list(map(str, args)), out=out), out.getvalue()


def test_export_takes_the_next_newest_when_the_newest_is_pruned_before_it_is_read(single_process, tmp_path,
                                                                                  monkeypatch):
    from hpcnet.ckpt import read

    _saved(tmp_path / "run", [1, 2, 3])
    _pruned_when_opened(monkeypatch, read, {"ckpt-0000000003.h5"})
    status, said = _run("export", tmp_path / "run", "-o", tmp_path / "m.pt")
    assert status == 0 and "(step 2)" in said and "ckpt-0000000003.h5 was deleted" in said
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["w"], torch.full((4, 256), 2.0))


def test_reads_that_keep_losing_their_checkpoint_end_in_one_line(single_process, tmp_path, monkeypatch, capsys):
    from hpcnet.ckpt import read

    _saved(tmp_path / "run", range(1, 9))
    _pruned_when_opened(monkeypatch, read)
    assert _run("export", tmp_path / "run", "-o", tmp_path / "m.pt")[0] == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "deleted while" in err and not (tmp_path / "m.pt").exists()
    # A file named on the command line that is deleted while it is read: said so, not a traceback.
    assert _run("export", tmp_path / "run" / "ckpt-0000000001.h5", "-o", tmp_path / "m.pt")[0] == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ckpt-0000000001.h5' was deleted while" in err
    # verify: each file gone before it is read, so nothing is verified; that is not a success.
    status, said = _run("verify", tmp_path / "run")
    assert status == 2 and said.count("gone   ckpt-") == 2 and "nothing verified" in capsys.readouterr().err


def test_list_inspect_and_verify_skip_what_is_pruned_while_they_read(single_process, tmp_path, monkeypatch):
    from hpcnet.ckpt import listing, read, validate

    directory = tmp_path / "run"
    _saved(directory, range(1, 7))
    real_scan = listing.scan

    def scan_then_prune(path):  # the oldest listed file deleted after each scan opened it, before its size is taken
        found = real_scan(path)
        Path(found[0][0].path).unlink()
        return found
    monkeypatch.setattr(listing, "scan", scan_then_prune)
    status, said = _run("list", directory)
    assert status == 0 and "ckpt-0000000005.h5" not in said and "ckpt-0000000006.h5" in said
    monkeypatch.undo()
    _saved(directory, [7])
    _pruned_when_opened(monkeypatch, validate, {"ckpt-0000000007.h5"})
    status, said = _run("inspect", directory)
    assert status == 0 and f"file: {directory / 'ckpt-0000000006.h5'}  (" in said
    monkeypatch.undo()
    _saved(directory, [8, 9])
    _pruned_when_opened(monkeypatch, read, {"ckpt-0000000008.h5"})
    status, said = _run("verify", directory)
    assert status == 0 and "ok     ckpt-0000000006.h5" in said and "ok     ckpt-0000000009.h5" in said
    assert "gone   ckpt-0000000008.h5" in said


def test_a_listing_that_loses_every_file_it_listed_lists_again(single_process, tmp_path, monkeypatch):
    """A run saving every step with checkpoint.keep=2 may replace both files of a listing before the scan opens
    them: the tool lists the directory again rather than show it empty."""
    from hpcnet.ckpt import listing

    directory = tmp_path / "run"
    _saved(directory, [1, 2])
    _saved(tmp_path / "later", [3])
    real = listing.open_read

    def open_read(path):
        if path.name in ("ckpt-0000000001.h5", "ckpt-0000000002.h5"):  # both pruned, a newer one committed
            for name in ("ckpt-0000000001.h5", "ckpt-0000000002.h5"):
                (directory / name).unlink(missing_ok=True)
            (tmp_path / "later" / "ckpt-0000000003.h5").replace(directory / "ckpt-0000000003.h5")
        return real(path)
    monkeypatch.setattr(listing, "open_read", open_read)
    status, said = _run("list", directory)
    assert status == 0 and "ckpt-0000000003.h5" in said and "ckpt-0000000002.h5" not in said
    monkeypatch.setattr(listing, "open_read", real)
    shutil.rmtree(directory)
    _saved(directory, [1, 2])
    _saved(tmp_path / "later", [3])
    monkeypatch.setattr(listing, "open_read", open_read)
    status, said = _run("verify", directory)
    assert status == 0 and "ok     ckpt-0000000003.h5" in said


def test_a_fifo_is_refused_in_one_line_and_never_opened(single_process, tmp_path):
    """Opening a FIFO waits for a writer: every command refuses one given as the path, and lists one in a
    directory as unreadable; in a child with a timeout, so that a wait fails the test instead of hanging it."""
    fifo = tmp_path / "ckpt-0000000001.h5"
    os.mkfifo(fifo)
    script = ("import sys\nfrom hpcnet.ckpt.tool import main\n"
              "for command in ('list', 'inspect', 'verify', 'export'):\n"
              "    print(command, main([command, sys.argv[1]]), flush=True)\n"
              "print('dir', main(['list', sys.argv[2]]))\n")
    done = subprocess.run([sys.executable, "-c", script, fifo, tmp_path], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines()[:4] == ["list 2", "inspect 2", "verify 2", "export 2"], done.stderr
    assert done.stderr.count("is a FIFO") == 4 and "Traceback" not in done.stderr
    assert "dir 0" in done.stdout and "unreadable" in done.stdout


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_export_refuses_an_output_that_is_not_a_regular_file(single_process, tmp_path, capsys, fmt):
    """A FIFO or a device at -o stays what it is (as root, -o /dev/null would otherwise replace the system's)."""
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    _saved(tmp_path / "run", [1])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outputs = [fifo]
    try:  # a device node of our own, never the system's (root only)
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        outputs.append(tmp_path / "null")
    except PermissionError:
        pass
    for out in outputs:
        assert _run("export", tmp_path / "run", "--format", fmt, "-o", out)[0] == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a regular file" in err
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert all(not stat.S_ISREG(p.stat().st_mode) for p in outputs) and sorted(tmp_path.iterdir()) == sorted(
        [tmp_path / "run", *outputs])


def test_export_leaves_the_optimizer_out_unless_asked_and_names_where_it_cannot_go(single_process, tmp_path, capsys):
    model, sgd, _ = model_and_optimizers()
    train_steps(model, [sgd], 2)
    with CheckpointManager(MPI.COMM_SELF, tmp_path / "run", async_save=False) as manager:
        entries = model_and_optimizer_state(model, sgd)
        manager.save(2, entries.tensors, entries.meta, rng_state())
    assert _run("export", tmp_path / "run", "-o", tmp_path / "model.pt")[0] == 0
    assert list(torch.load(tmp_path / "model.pt", weights_only=True)) == list(model.state_dict())  # model only
    code, said = _run("export", tmp_path / "run", "--optimizer", "-o", tmp_path / "both.pt")
    both = torch.load(tmp_path / "both.pt", weights_only=True)
    assert code == 0 and "SGD's 'optimizer'" in said and both["optimizer_class"] == "SGD"
    assert_same_tensors(both["model"], model.state_dict())
    again = torch.optim.SGD(list(model[0].parameters()) + list(model[1].parameters()), lr=0.1, momentum=0.9)
    again.load_state_dict(both["optimizer"])
    for p in again.param_groups[0]["params"]:
        assert torch.equal(again.state[p]["momentum_buffer"], sgd.state[p]["momentum_buffer"])
    assert _run("export", tmp_path / "run", "--optimizer", "--format", "safetensors")[0] == 2
    assert "--optimizer is for --format pt only" in capsys.readouterr().err
    _saved(tmp_path / "plain", [1])  # a checkpoint without an optimizer
    assert _run("export", tmp_path / "plain", "--optimizer", "-o", tmp_path / "none.pt")[0] == 2
    assert "holds no optimizer state" in capsys.readouterr().err
