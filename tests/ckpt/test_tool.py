"""hpcnet.ckpt.tool: ``python -m hpcnet.ckpt`` list, inspect, verify, export."""

import io
import shutil
import subprocess
import sys

import h5py
import pytest
import torch
from mpi4py import MPI

from hpcnet.ckpt.load import load_checkpoint
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.ckpt.state import flatten_state, rng_state
from tests.helpers.ckpt import assert_same_tensors, flip_bytes_in, model_and_optimizers, train_steps
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
            tensors, meta = flatten_state(model, sgd)
            manager.save(step, tensors, {"state": meta}, rng_state())
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
