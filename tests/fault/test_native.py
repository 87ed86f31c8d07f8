"""The native watchdog: it ends a process in which no Python code can run, and a disarmed one does nothing."""

import json
import os
import subprocess
import sys
import time

import pytest
from mpi4py import MPI

from hpcnet.errors import ExitCode
from tests.helpers.launch import PROGRAMS, ROOT


@pytest.mark.timeout(60)
def test_native_watchdog_ends_a_process_whose_python_cannot_run(tmp_path):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own processes; runs in the serial pass")
    script = PROGRAMS / "native_watchdog.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "hold"], env=env, capture_output=True,
                         text=True, timeout=30)
    elapsed = time.monotonic() - started
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    assert elapsed < 10
    assert "it's the native watchdog" in out.stderr
    assert "in block_holding_the_gil" in out.stderr and "most recent call first" in out.stderr  # every thread
    report = json.loads((tmp_path / "failure.json").read_text())
    assert report == {"kind": "checkpoint", "why": "a 'quoted' $(reason) `here`"}  # the shell quoting holds
    (tmp_path / "failure.json").unlink()
    calm = subprocess.run([sys.executable, str(script), str(tmp_path), "disarm"], env=env, capture_output=True,
                          text=True, timeout=30)
    assert calm.returncode == 0 and "still alive" in calm.stdout and not (tmp_path / "failure.json").exists()
