"""Running programs under mpirun: the repository's paths, a child's environment, polling for what it does."""

import os
import time
from pathlib import Path

from hpcnet.bench import common

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ROOT / "tests" / "programs"
"""Programs that tests launch under mpirun."""


def clean_env(**extra):
    """The environment for a child mpirun: none of this process's MPI wiring."""
    from hpcnet.comm.bootstrap import SET_ENV

    # Nor what an in-process data plane of this session set (GLOO_SOCKET_IFNAME=lo would pin a job's gloo on
    # every host to loopback).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_")) and SET_ENV.get(k) != v}
    # Blocked MPI calls yield the core: the suite's jobs share the machine with each other (scripts/test.sh runs
    # two at once) and with the tests, more ranks than cores whatever one job sees of it.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_base_warn_component_unused="0",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONPATH=str(ROOT))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP workers sleep, as in scripts/test.sh (its reason)
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


class Watched(common.Watched):
    """``hpcnet.bench.common.Watched`` in the tests' environment (``clean_env``) unless given another."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(command, cwd, env if env is not None else clean_env())
