"""Whether the job's MPI survives a lost rank (ULFM), and what fault.recovery resolves to.

In-process under the MPI that runs the tests (the system's Open MPI 4.1: no ULFM); the fault-tolerant Open MPI 5
(scripts/ftmpirun) through jobs of ``python -m hpcnet.fault.ulfm``, skipped where set-up could not install it.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcnet.agree import is_agreed
from hpcnet.config.load import load_config
from hpcnet.errors import ConfigError, ExitCode
from hpcnet.fault.ulfm import FaultTolerance, agree, detect, recovery_mode
from tests.helpers.launch import ROOT, clean_env

FTMPIRUN = ROOT / "scripts" / "ftmpirun"
ACTIVE = FaultTolerance(True, True, "Open MPI 5.0.11")
INACTIVE = FaultTolerance(True, False, "Open MPI 5.0.11", "the job was not started with fault tolerance on "
                                                          "(mpirun --with-ft ulfm)")
NONE = FaultTolerance(False, False, "Open MPI 4.1.4", "Open MPI 4.1.4 has no ULFM (Open MPI >= 5 has)")




@pytest.mark.mpi
def test_the_system_mpi_offers_no_ulfm_on_any_rank(comm):
    vendor, version = MPI.get_vendor()
    if vendor == "Open MPI" and version >= (5,):
        pytest.skip(f"the tests run under {vendor} {version}: this test is about the system's Open MPI 4")
    ft = detect(comm)
    assert not ft.available and not ft.active and ft.library.startswith("Open MPI 4"), ft
    assert ft.why == f"{ft.library} has no ULFM (Open MPI >= 5 has)" and ft.describe() == f"no ULFM: {ft.why}"
    assert comm.allgather(ft) == [ft] * comm.Get_size()
    assert recovery_mode("auto", ft) == "restart"


def test_auto_shrinks_only_where_ulfm_is_active_and_restart_is_always_possible():
    assert recovery_mode("auto", ACTIVE) == "shrink" and recovery_mode("shrink", ACTIVE) == "shrink"
    for ft in (ACTIVE, INACTIVE, NONE):
        assert recovery_mode("restart", ft) == "restart"
    assert recovery_mode("auto", INACTIVE) == "restart" and recovery_mode("auto", NONE) == "restart"
    assert ACTIVE.describe() == "ULFM active (Open MPI 5.0.11)"


@pytest.mark.parametrize("ft, missing", [
    (INACTIVE, "the job was not started with fault tolerance on (mpirun --with-ft ulfm)"),
    (NONE, "Open MPI 4.1.4 has no ULFM (Open MPI >= 5 has)"),
])
def test_shrink_without_active_ulfm_is_an_error_naming_the_option_what_is_missing_and_the_command(ft, missing):
    with pytest.raises(ConfigError) as caught:
        recovery_mode("shrink", ft)
    message = str(caught.value)
    assert message.startswith("fault.recovery=shrink needs an MPI that survives a lost rank") and missing in message
    assert "launch with scripts/ftmpirun" in message and "or set fault.recovery=restart" in message
    assert caught.value.exit_code == ExitCode.USAGE_ERROR and is_agreed(caught.value)  # every rank raises it alike


def test_fault_recovery_takes_auto_shrink_or_restart():
    assert load_config().fault.recovery == "auto"
    assert load_config(overrides=["fault.recovery=shrink"]).fault.recovery == "shrink"
    with pytest.raises(ConfigError, match=r"fault.recovery: 'sometimes' is not one of 'auto', 'shrink', 'restart'"):
        load_config(overrides=["fault.recovery=sometimes"])


def test_the_ranks_agree_on_the_weakest_and_name_the_rank_that_lacks_it():
    active = (True, True, "Open MPI 5.0.11", "", "n1")
    assert agree([active, active]) == ACTIVE
    inactive = (True, False, "Open MPI 5.0.11", INACTIVE.why, "n2")
    assert agree([inactive, inactive]) == INACTIVE  # the same everywhere: no rank to name
    mixed = agree([active, inactive, active])
    assert not mixed.active and mixed.available and mixed.why == f"rank 1 on n2: {INACTIVE.why}"
    other = agree([active, (False, False, "Open MPI 4.1.4", NONE.why, "n3")])
    assert (other.available, other.active, other.library) == (False, False, "Open MPI 5.0.11")
    assert other.why == f"rank 1 on n3: {NONE.why}"


def test_the_venv_has_no_mpirun_or_libmpi_of_its_own():
    """The fault-tolerant Open MPI lives in the venv's ompi5/: plain mpirun stays the system's, and mpi4py (which
    looks in <venv>/lib first) the system's libmpi under it."""
    venv = Path(sys.prefix)
    assert not any((venv / "bin" / name).exists() for name in ("mpirun", "mpiexec", "prterun"))
    assert not list((venv / "lib").glob("libmpi.so*"))


def _probe(launcher: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, "-np", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnet.fault.ulfm"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_a_job_started_with_ftmpirun_has_ulfm_active_and_one_without_with_ft_has_not(tmp_path):
    version = subprocess.run([str(FTMPIRUN), "--version"], capture_output=True, text=True, env=clean_env(),
                             timeout=60)
    if version.returncode == 127:
        pytest.skip(f"no fault-tolerant MPI here: {version.stderr.strip()}")
    assert "Open MPI) 5." in version.stdout, version.stdout + version.stderr
    out = _probe([str(FTMPIRUN)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ULFM active (Open MPI 5.") and "fault.recovery=auto means shrink" in out.stdout
    venv_mpirun = Path(sys.prefix) / "ompi5" / "bin" / "mpirun"
    if venv_mpirun.exists():  # the same Open MPI 5, started without --with-ft ulfm
        plain = _probe([str(venv_mpirun)], tmp_path)
        assert plain.returncode == 0, plain.stderr
        assert plain.stdout.startswith("no ULFM: the job was not started with fault tolerance on"), plain.stdout


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_a_job_under_the_system_mpirun_restarts(tmp_path):
    out = _probe(["mpirun"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no ULFM: ") and "fault.recovery=auto means restart (2 rank(s))" in out.stdout
