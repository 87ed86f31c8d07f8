"""The local multi-host cluster of scripts/cluster.sh, as the tests use it (the ``cluster`` fixture is in
tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.launch import ROOT, clean_env

CLUSTER = ROOT / "scripts" / "cluster.sh"
STATE = Path(os.environ.get("HPCNET_CLUSTER_DIR", "/run/hpcnet-cluster"))


def cli(*args: str, check: bool = True, timeout: float = 120, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    """``scripts/cluster.sh ARGS``; ``env``: HPCNET_CLUSTER_* of another cluster than the default one."""
    out = subprocess.run([str(CLUSTER), *args], env=clean_env(**(env or {})), capture_output=True, text=True,
                         timeout=timeout)
    if check:
        assert out.returncode == 0, f"cluster.sh {' '.join(args)}: {out.returncode}\n{out.stdout}{out.stderr}"
    return out


def another_cluster(cluster: "Cluster", suffix: str, third_octet_step: int = 1) -> dict[str, str]:
    """HPCNET_CLUSTER_* for a second cluster beside ``cluster`` (its prefix + ``suffix``, the next /24, its own
    state directory): names, addresses and state that cannot collide with it."""
    a, b, c = cluster.config["net"].split(".")
    return {"HPCNET_CLUSTER_PREFIX": cluster.config["prefix"] + suffix,
            "HPCNET_CLUSTER_NET": f"{a}.{b}.{(int(c) + third_octet_step) % 250}",
            "HPCNET_CLUSTER_DIR": f"{cluster.state}-{suffix}"}


class Cluster:
    """The running cluster as its state directory describes it (``env``: that of another cluster)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = dict(env or {})
        self.state = Path(self.env.get("HPCNET_CLUSTER_DIR", str(STATE)))
        self.config = dict(line.split("=", 1) for line in (self.state / "config").read_text().split())
        # hostmap: namespace hostname address interface veth
        self.rows = [line.split() for line in (self.state / "hostmap").read_text().splitlines()]
        self.namespaces = [row[0] for row in self.rows]
        self.hostnames = [row[1] for row in self.rows]
        self.addresses = [row[2] for row in self.rows]
        self.slots = int(self.config["slots"])

    def interface(self, host: str) -> str:
        return Cluster(self.env).rows[self.hostnames.index(host)][3]

    def pids(self, host: str) -> list[str]:
        ns = self.namespaces[self.hostnames.index(host)]
        return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return cli(*args, check=check, timeout=timeout, env=self.env)

    def mpirun(self, cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(CLUSTER), "mpirun", *args], cwd=cwd, env=clean_env(**self.env),
                              capture_output=True, text=True, timeout=timeout)

    def python(self, cwd: Path, np: int, code: str, *mpirun_args: str, timeout: float = 60):
        """``scripts/cluster.sh mpirun -np NP python -c CODE``: its output, the job having ended with 0."""
        out = self.mpirun(cwd, "-np", str(np), *mpirun_args, sys.executable, "-c", code, timeout=timeout)
        assert out.returncode == 0, f"{out.returncode}\n{out.stdout}{out.stderr}"
        return out.stdout
