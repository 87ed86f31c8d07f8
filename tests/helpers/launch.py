"""Running programs under mpirun: the repository's paths, a child's environment, polling for what it does."""

import os
import re
import subprocess
import threading
import time
from pathlib import Path

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


class Watched:
    """A process (``python -m hpcnet.launch ...``, say) whose merged output is read, with the time of each line,
    as it comes."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(command, cwd=cwd, env=env if env is not None else clean_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def said(self, pattern: str, after: float = 0.0) -> float | None:
        """When a line matching the regular expression ``pattern`` first came (at ``after`` or later); None if
        none has."""
        regex = re.compile(pattern)
        return next((when for when, line in list(self.lines) if when >= after and regex.search(line)), None)

    def stop(self) -> None:
        """End it if it still runs: SIGTERM first (the supervisor ends its attempt's launcher), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
