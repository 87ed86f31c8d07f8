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


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (more time or memory than the default suite has: "
                          "scripts/test.sh --slow, docs/testing.md)")


SHARED = {"cluster": "tests/test_cluster", "slurm": "tests/test_slurm.py"}
"""The tests that share one resource, by marker: the local cluster (whose fault verbs kill, cut and slow whole
hosts) and the local SLURM's one node; and where they are (test ids start so)."""


ONE_WORKER = ("tests/launch/test_supervisor.py", "tests/launch/test_standby.py", "tests/test_live.py")
"""Files whose tests compare against a job that a module-scoped fixture runs (the uninterrupted reference run): each
file's tests run on one worker, one after the other, so that the job runs once, not once on every worker that
takes one of its tests (10-15 s each time)."""


LONG_FIRST = ("tests/test_docs.py", "tests/test_resume.py", "tests/fault/test_watchdog.py", "tests/launch/",
              "tests/test_train.py", "tests/ckpt/test_full_disk.py", "tests/bench/", "tests/test_live.py")
"""Files whose tests take 5-50 s each (``--durations``): started right after SHARED's on the workers."""


def worker_scope(nodeid: str) -> str:
    """The unit of the serial pass's scheduling that a test belongs to: its ``SHARED`` resource, its
    ``ONE_WORKER`` file, or the test alone."""
    module = nodeid.split("::", 1)[0]
    return next((name for name, prefix in SHARED.items() if nodeid.startswith(prefix)),
                module if module in ONE_WORKER else nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The serial pass runs on pytest-xdist's workers (scripts/test.sh: ``-n $HPCNET_TEST_WORKERS --dist
    loadgroup``); the tests of each ``SHARED`` resource, and of each ``ONE_WORKER`` file, run on one worker, one
    after the other, all others wherever a worker is free.

    xdist's own loadgroup reads ``xdist_group`` marks from suffixes it writes into the test ids, which pytest 9
    no longer lets it change: the ids here are grouped by where the tests are instead (the controller sees ids
    only), and ``pytest_collection_modifyitems`` checks that every marked test is where ``SHARED`` says."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedResourceScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return SharedResourceScheduling(config, log)


def _check_mpi_files(items):
    """Every test marked ``mpi`` is in a file that the MPI passes collect (tests/helpers/mpi_files.py)."""
    from tests.helpers.mpi_files import mpi_files

    root = Path(__file__).resolve().parents[1]
    listed = set(mpi_files(root))
    for item in items:
        if item.get_closest_marker("mpi") and item.nodeid.split("::", 1)[0] not in listed:
            raise pytest.UsageError(f"{item.nodeid} is marked mpi but its file does not say 'mark.mpi': the MPI "
                                    "passes would not collect it (tests/helpers/mpi_files.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, prefix in SHARED.items():
            if item.get_closest_marker(name) and not item.nodeid.startswith(prefix):
                raise pytest.UsageError(f"{item.nodeid} is marked {name} but is not in {prefix}*: the parallel "
                                        "serial pass would run it beside the other tests of that resource "
                                        "(tests/conftest.py, SHARED)")
    if MPI.COMM_WORLD.Get_size() == 1:
        _check_mpi_files(items)
    if hasattr(config, "workerinput"):
        # On xdist's workers (every worker collects, in the same order): the long groups of SHARED first, then
        # the files of long tests, so that what is left at the end is short and no worker waits long for the
        # other with nothing to do.
        def order(item):
            if item.nodeid.startswith(tuple(SHARED.values())):
                return 0
            return 1 if item.nodeid.startswith(LONG_FIRST) else 2

        items.sort(key=order)
    if not config.getoption("slow"):
        slow = pytest.mark.skip(reason="marked slow: runs with --slow (scripts/test.sh --slow, docs/testing.md)")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(slow)
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
    from hpcnet.world import discover

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
