"""Shared fixtures: the MPI communicator, a data plane, and launching hpcnet with mpirun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.helpers.cluster import Cluster, cli
from tests.helpers.launch import clean_env


def pytest_configure(config):
    # Ranks of one pytest job race on pytest's own temp folder: give each its own.
    if MPI.COMM_WORLD.Get_size() > 1 and not config.option.basetemp:
        base = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpcnet-pytest-{os.getppid()}-rank{MPI.COMM_WORLD.Get_rank()}"
        config.option.basetemp = str(base)


def pytest_collection_modifyitems(config, items):
    # At more than one rank every rank would start the same mpirun, SLURM or cluster job at once.
    if MPI.COMM_WORLD.Get_size() == 1:
        return
    skip = pytest.mark.skip(reason="starts its own mpirun or SLURM job: runs in the serial pass (scripts/test.sh)")
    for item in items:
        if any(item.get_closest_marker(name) for name in ("launch", "slurm", "cluster")):
            item.add_marker(skip)


@pytest.fixture
def comm():
    """A private duplicate of COMM_WORLD, freed after the test."""
    dup = MPI.COMM_WORLD.Dup()
    yield dup
    dup.Free()


@pytest.fixture(scope="session")
def data_plane():
    """torch.distributed (gloo) over COMM_WORLD, initialised once per session."""
    import torch

    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.comm.world import discover

    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    plane = init_data_plane(comm, world, backend="gloo", device=torch.device("cpu"), timeout_s=120)
    yield plane
    plane.close()
    comm.Free()


@pytest.fixture
def launch(tmp_path):
    """Run ``mpirun -np N python -m mpi4py -m <module> args`` and return the CompletedProcess."""
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpirun; runs in the serial pass")

    def _launch(np, *args, module="hpcnet.train", timeout=180, env=None):
        """``module=None`` runs the script named by the first argument instead."""
        target = ["-m", module] if module else []
        cmd = ["mpirun", "-np", str(np), sys.executable, "-m", "mpi4py", *target, *args]
        return subprocess.run(cmd, cwd=tmp_path, env=clean_env(**(env or {})), capture_output=True,
                              text=True, timeout=timeout)

    return _launch


@pytest.fixture(scope="session")
def cluster():
    """The running local cluster, or one started here and stopped after the session."""
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network namespaces): run as root, see docs/testing.md")
    started = False
    if cli("status", check=False).returncode != 0:
        if os.environ.get("HPCNET_CLUSTER", "on") == "off":
            pytest.skip("HPCNET_CLUSTER=off and no local cluster is running (scripts/cluster.sh, docs/testing.md)")
        start = cli("start", check=False)
        if start.returncode != 0:
            pytest.skip(f"the local cluster did not start: {(start.stderr or start.stdout).strip()}")
        started = True
    yield Cluster()
    if started:
        cli("stop", check=False)
