"""The test command a user types, ``mpiexec -n 4 pytest``, runs the MPI tests instead of skipping them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, clean_env


@pytest.mark.mpi(min_size=2)
def test_ranks_reach_each_other(comm):
    assert comm.allreduce(1) == comm.Get_size()
    assert sorted(comm.allgather(comm.Get_rank())) == list(range(comm.Get_size()))


@pytest.mark.launch
def test_plain_mpiexec_pytest_runs_the_mpi_tests():
    # Nothing but `mpiexec -n 2 pytest FILE`: the MPI test above must pass on both ranks, and this test (it
    # starts an mpirun of its own) must skip there, for that reason.
    if os.environ.get("HPCNET_NESTED_PYTEST"):
        pytest.skip("nested run of this test")  # never recurse, whatever the configuration does
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", PY_COLORS="0",
                    HPCNET_NESTED_PYTEST="1")
    result = subprocess.run(["mpiexec", "-n", "2", "pytest", "tests/test_pytest_setup.py", "-q"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The two ranks write to one stream: a summary line may run into the other's ("...in 0.04s1 passed, ..."),
    # so the count looks for the words, not for a word boundary before them.
    found = re.findall(r"(?<!\d)1 passed, 1 skipped\b", result.stdout)
    assert found == ["1 passed, 1 skipped"] * 2, result.stdout[-3000:]
    assert "starts its own mpirun" in result.stdout

