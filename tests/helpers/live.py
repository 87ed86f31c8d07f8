"""Jobs under a fault-tolerant MPI (scripts/ftmpirun) for the live-recovery tests: their options, their outcome."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from tests.helpers.launch import ROOT, clean_env

FTMPIRUN = ROOT / "scripts" / "ftmpirun"
STEPS, KILL_AT, EVERY = 12, 7, 4
ATOL, RTOL = 1e-6, 1e-5
"""What the shrunk run may differ by: SGD with momentum for 12 steps of a small MLP, whose gradient sums differ
from the uninterrupted run's in order only (measured: 4e-8 at most)."""


def ft_env() -> dict[str, str]:
    """The environment of a job under scripts/ftmpirun: the tests' own, more ranks than cores by slot."""
    return clean_env(PRTE_MCA_rmaps_default_mapping_policy="slot:oversubscribe")


def ftmpi() -> str:
    """scripts/ftmpirun, or a skip where set-up could not install its MPI."""
    version = subprocess.run([str(FTMPIRUN), "--version"], capture_output=True, text=True, env=ft_env(), timeout=60)
    if version.returncode == 127:
        pytest.skip(f"no fault-tolerant MPI here: {version.stderr.strip()}")
    return str(FTMPIRUN)


def train_args(data: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", f"data.dataset={data}", f"run.dir={runs}",
            f"run.name={name}", "model.name=mlp", "model.options.hidden=[32]", f"train.steps={STEPS}",
            "train.batch_size=8", "train.eval_every=0", "run.log_every=1", f"checkpoint.every_steps={EVERY}",
            "checkpoint.async_save=false", "dist.probe=false", *extra]


def run_job(launcher: list[str], args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, *args], cwd=cwd, env=ft_env(), capture_output=True, text=True,
                          timeout=timeout)


def final_tensors(runs: Path, name: str) -> dict[str, torch.Tensor]:
    from hpcnet.ckpt.load import load_checkpoint
    from hpcnet.ckpt.schema import join_pieces

    loaded = load_checkpoint(MPI.COMM_SELF, "auto", runs / f"{name}.ckpt")  # its checksums verified
    assert loaded.step == STEPS
    return join_pieces({k: v for k, v in loaded.tensors.items() if k.startswith("model/")})


def summary(runs: Path, name: str) -> dict:
    return json.loads(sorted(runs.glob(f"{name}-*/summary.json"))[-1].read_text())  # the newest run's


def assert_close(tensors, reference):
    assert sorted(tensors) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(tensors[name], value, atol=ATOL, rtol=RTOL, msg=name)
