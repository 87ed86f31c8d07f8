"""Helpers shared by the tests (fixtures are in ``conftest.py``): one copy of each, imported as ``tests.helpers``."""

import os
import signal
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "programs"
"""Programs that tests launch under mpirun."""


class StopAfter:
    """Stands in for the signal handler: asks to stop (SIGUSR2) after ``steps`` steps."""

    def __init__(self, steps):
        self.calls, self.steps = 0, steps

    @property
    def signum(self):
        self.calls += 1
        return signal.SIGUSR2 if self.calls >= self.steps else 0


def tiny_images(comm, directory: Path, name: str, *, num_train: int, num_eval: int, seed: int) -> Path:
    """A small 4-class 1x8x8 image set shared by the ranks of ``comm``: rank 0 writes it once (collective)."""
    from hpcnet.data.synthetic import generate_images

    path = directory / name
    if comm.Get_rank() == 0 and not path.exists():
        generate_images(path, num_train=num_train, num_eval=num_eval, shape=(1, 8, 8), num_classes=4, seed=seed)
    comm.Barrier()
    return path


def clean_env(**extra):
    """The environment for a child mpirun: none of this process's MPI wiring."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_base_warn_component_unused="0",
               PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def wait_for(condition, timeout_s):
    """Poll ``condition`` until it is true or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def rank_state(step, seq, op="step_boundary", bucket=-1, open_seq=0, open_op="none", open_s=0.0):
    """A rank's answer to a stall notice, as the monitor collects it (the flight recorder's part)."""
    return {"step": step, "seq": seq, "op": op, "bucket": bucket, "open_seq": open_seq, "open_op": open_op,
            "open_bucket": bucket if open_seq else -1, "open_s": open_s}
