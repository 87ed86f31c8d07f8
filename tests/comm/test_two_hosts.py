"""Two real network hosts on this machine (network, UTS and mount namespaces joined by a bridge), their
interfaces named differently: the default job picks each host's own interface and finishes.

Self-contained: it builds its two hosts, runs one short job across them and tears everything down; it skips, with
the reason, where namespaces cannot be made (not root, no ``ip``/``unshare``, a sandbox that refuses them).
"""

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.launch import ROOT, clean_env


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class TwoHosts:
    """Hosts ``<tag>x`` (interface ``ethx0``, .1) and ``<tag>y`` (``ethy0``, .2) on bridge ``<tag>br`` (.254)."""

    def __init__(self, tmp_path):
        tag = f"hq{os.getpid() % 100000}"
        self.br, self.hosts = f"{tag}br", {f"{tag}x": "x", f"{tag}y": "y"}
        third = 100 + os.getpid() % 150  # a private /24 that nothing else on this machine uses
        used = _ip("-o", "-4", "addr").stdout
        while f"10.78.{third}." in used:
            third += 1
        self.net = f"10.78.{third}"
        self.addresses = {name: f"{self.net}.{i + 1}" for i, name in enumerate(self.hosts)}
        self.tmp = tmp_path
        self.made: list[tuple[str, ...]] = []

    def up(self) -> None:
        _ip("link", "add", self.br, "type", "bridge")
        self.made.append(("link", "del", self.br))
        _ip("addr", "add", f"{self.net}.254/24", "dev", self.br)
        _ip("link", "set", self.br, "up")
        for name, letter in self.hosts.items():
            _ip("netns", "add", name)
            self.made.append(("netns", "del", name))
            outer, inner = f"{name}v", f"eth{letter}0"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.made.append(("link", "del", outer))
            _ip("link", "set", inner, "netns", name)
            _ip("link", "set", outer, "master", self.br)
            _ip("link", "set", outer, "up")
            _ip("-n", name, "addr", "add", f"{self.addresses[name]}/24", "dev", inner)
            _ip("-n", name, "link", "set", inner, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        hosts = self.tmp / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addresses.items()))
        cases = "".join(f"  {a}|{n}) ns={n};;\n" for n, a in self.addresses.items())
        self.agent = self.tmp / "agent.sh"
        self.agent.write_text(textwrap.dedent("""\
            #!/bin/bash
            # Open MPI's rsh agent: AGENT HOST command...; runs the command inside that host's namespaces.
            host=$1; shift
            case "$host" in
            {cases}  *) echo "unknown host $host" >&2; exit 1;;
            esac
            exec ip netns exec $ns unshare --uts --mount sh -c "hostname $ns; mount --bind {hosts} /etc/hosts; $*"
            """).format(cases=cases, hosts=hosts))
        self.agent.chmod(0o755)

    def down(self) -> None:
        for name in self.hosts:  # nothing started on a host outlives the test
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(int(pid), 9)
        for args in reversed(self.made):
            _ip(*args, check=False)

    def mpirun(self, ranks_per_host: int) -> list[str]:
        hosts = ",".join(f"{a}:{ranks_per_host}" for a in self.addresses.values())
        return ["mpirun", "--mca", "plm_rsh_agent", str(self.agent), "--host", hosts,
                "-np", str(ranks_per_host * len(self.hosts)),
                "--mca", "oob_tcp_if_include", f"{self.net}.0/24", "--mca", "btl_tcp_if_include", f"{self.net}.0/24",
                "-x", "PATH", "-x", "PYTHONPATH", "-wdir", str(ROOT)]


def _reason_namespaces_cannot_be_made() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("unshare")):
        return "needs ip (iproute2) and unshare (util-linux)"
    probe = f"hqprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"ip netns add is refused here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@pytest.fixture
def two_hosts(tmp_path):
    reason = _reason_namespaces_cannot_be_made()
    if reason:
        pytest.skip(reason)
    hosts = TwoHosts(tmp_path)
    try:
        hosts.up()
        yield hosts
    finally:
        hosts.down()


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_the_default_job_runs_across_two_hosts_whose_interfaces_are_named_differently(two_hosts, tmp_path):
    run = tmp_path / "run"
    cmd = [*two_hosts.mpirun(1), sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
           "data.dataset=synthetic-images", f"data.dir={tmp_path / 'data'}", "data.options.num_train=256",
           "data.options.num_eval=32", f"run.dir={run}", "run.dir_exact=true", f"checkpoint.dir={tmp_path / 'ckpt'}",
           "model.name=mlp", "train.batch_size=8", "train.steps=3", "train.eval_every=0",
           "dist.startup_timeout_s=60"]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (x, ax), (y, ay) = two_hosts.addresses.items()
    log = (run / "rank0.log").read_text()
    assert f"network interface on {x} (rank 0): ethx0 {ax} (holds {ax})" in log
    assert f"network interface on {y} (rank 1): ethy0 {ay} (same subnet as {ax})" in log
    assert "GLOO_SOCKET_IFNAME=ethy0" in (run / "rank1.log").read_text()
    assert "done: 3 steps" in out.stdout + out.stderr
