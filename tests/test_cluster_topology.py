"""The topology probe on the local multi-host cluster of scripts/cluster.sh: each host's interface and links,
the measured inter-host bandwidth against the link rate set with tc, and a slow host named.

Each test sets the link rates it needs with ``cluster.sh slow`` and puts back the rates the cluster had.  The
slow-host test needs 3 hosts: with two a slow link is one link, and which end is slow cannot be told (the
two-host test checks what is said instead); it starts a cluster of 3 hosts of its own beside the suite's
(another prefix, subnet and state directory: ``another_cluster``) and stops it afterwards.

The rates are real only while the machine can drive them: when a figure is off twice and the load average is
over twice the cores (other jobs starve the ranks, and the CPU, not the link, sets the rate), a test skips
with the figures and the load instead of failing.
"""

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from contextlib import contextmanager

import pytest
from mpi4py import MPI

from tests.helpers.cluster import Cluster, another_cluster, cli
from tests.helpers.launch import clean_env

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(150),
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts mpirun on the local cluster; serial pass"),
]

LINK_GBIT = 1.0
SLOW_GBIT = 0.2


@contextmanager
def rates(cluster: Cluster, **per_host: str):
    """Every host at LINK_GBIT, those named at their rate, for the block; then each host's rate as it was."""
    before = {host: re.search(r" tbf (\S+) ", line + " ") for host, line in
              zip(cluster.hostnames, cluster.cli("status").stdout.splitlines()[1:])}
    cluster.cli("slow", "all", str(LINK_GBIT))
    try:
        for host, rate in per_host.items():
            cluster.cli("slow", host, rate)
        yield
    finally:
        cluster.cli("slow", "all", "off")
        for host, rate in before.items():
            if rate:
                cluster.cli("slow", host, rate.group(1).lower())


@pytest.fixture
def three_hosts(cluster):
    """A cluster of 3 hosts x 1 slot beside the suite's, stopped afterwards."""
    env = another_cluster(cluster, "t")
    start = cli("start", "--hosts", "3", "--slots", "1", check=False, env=env)
    if start.returncode != 0:
        pytest.skip(f"a second cluster of 3 hosts did not start: {(start.stderr or start.stdout).strip()}")
    try:
        yield Cluster(env)
    finally:
        cli("stop", check=False, env=env)


def _twice(measure: Callable[[], tuple[bool, str]]) -> None:
    """``measure()`` -> (as expected, what was measured); a second try when not; then fail, or skip on a busy
    machine (load average over twice the cores)."""
    for _ in range(2):
        ok, seen = measure()
        if ok:
            return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 2 * cores:
        pytest.skip(f"the machine is too busy to drive the links (load average {load:.0f} on {cores} cores): {seen}")
    pytest.fail(seen)


def _probe(cluster: Cluster, tmp_path, hosts: str, np: int) -> tuple[dict, str]:
    """``python -m hpcnet.comm.topology`` on ``hosts`` (mpirun's --host): topology.json and the printed text."""
    out = tmp_path / "topo"
    run = cluster.mpirun(tmp_path, "-np", str(np), "--host", hosts, sys.executable, "-m", "mpi4py", "-m",
                         "hpcnet.comm.topology", "--out", str(out), "--budget-s", "2", timeout=60)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "topology.json").read_text()), run.stdout


def test_two_hosts_each_show_ranks_interface_and_a_link_at_the_set_rate(cluster, tmp_path):
    a, b = cluster.hostnames[:2]

    def measure():
        data, text = _probe(cluster, tmp_path, f"{a}:2,{b}:2", 4)
        hosts = {h["name"]: h for h in data["hosts"]}
        assert list(hosts) == [a, b] and [hosts[a]["ranks"], hosts[b]["ranks"]] == [[0, 1], [2, 3]], data["hosts"]
        for host, address in zip((a, b), cluster.addresses):
            assert hosts[host]["interface"]["name"] == cluster.interface(host), hosts[host]
            assert hosts[host]["interface"]["address"] == address, hosts[host]
            assert hosts[host]["intra_bandwidth_gbps"] > 0 and hosts[host]["peers"] == 1
        assert f"host {a} (ranks 0-1): {cluster.interface(a)} {cluster.addresses[0]} (holds " in text, text
        assert f"host {b} (ranks 2-3): {cluster.interface(b)} {cluster.addresses[1]} (same subnet as " in text, text
        # The one inter-host pair, both ways and its two-way figure, within 25% of the tc rate; equal hosts.
        inter = [data["bandwidth_gbps"]["0-2"], data["directed_gbps"]["0->2"], data["directed_gbps"]["2->0"]]
        ok = all(0.75 * LINK_GBIT < gbps < 1.25 * LINK_GBIT for gbps in inter) and data["warnings"] == []
        return ok, f"inter-host Gbit/s (two-way, {a}->{b}, {b}->{a}) {inter} at {LINK_GBIT}; {data['warnings']}"

    with rates(cluster):
        _twice(measure)


def test_two_hosts_with_one_slowed_name_the_direction_in_the_log_the_json_and_the_report(cluster, tmp_path):
    """The rate limit is on what the slowed host sends: the probe names that direction, and neither host (the
    receiving end could be the slow one).  A training job logs it, writes it and the report shows it."""
    a, b = cluster.hostnames[:2]
    runs = []

    def measure():
        run = tmp_path / f"run{len(runs)}"  # a directory per try
        runs.append(run)
        out = cluster.mpirun(tmp_path, "-np", "2", "--host", f"{a}:1,{b}:1", sys.executable, "-m", "mpi4py", "-m",
                             "hpcnet.train", "train.steps=1", "train.eval_every=0", "run.log_every=1",
                             f"run.dir={run}", "run.dir_exact=true", "dist.startup_timeout_s=60", timeout=100)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        data = json.loads((run / "topology.json").read_text())
        assert data["slow_hosts"] == [], data["hosts"]
        links = [(s["source"], s["target"], s["gbps"]) for s in data["slow_links"]]
        ok = len(links) == 1 and links[0][:2] == (b, a) and 0.75 * SLOW_GBIT < links[0][2] < 1.25 * SLOW_GBIT
        return ok, f"slow directions {links}, expected {b} -> {a} at {SLOW_GBIT} Gbit/s; {data['directed_gbps']}"

    with rates(cluster, **{b: str(SLOW_GBIT)}):
        _twice(measure)
    run = runs[-1]
    [warning] = json.loads((run / "topology.json").read_text())["warnings"]
    assert warning.startswith(f"link {b} -> {a} measured ") and "the slow end cannot be told" in warning, warning
    log = (run / "rank0.log").read_text()
    assert re.search(rf"rank 0 WARNING hpcnet\.comm\.topology: {re.escape(warning)}$", log, flags=re.M), log[-3000:]
    for host, rank in ((a, 0), (b, 1)):  # the header: each host, its rank and interface
        assert f"host {host} (rank {rank}): {cluster.interface(host)} " in log, log[-3000:]
    report = subprocess.run([sys.executable, "-m", "hpcnet.report", str(run)], env=clean_env(), capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stdout + report.stderr
    text = (run / "report" / "report.md").read_text()
    assert "## Hosts and links" in text and f"- **warning:** {warning}" in text, text


def test_a_slow_host_among_three_is_named(three_hosts, tmp_path):
    cluster = three_hosts
    a, b, c = cluster.hostnames[:3]

    def measure():
        data, text = _probe(cluster, tmp_path, f"{a}:1,{b}:1,{c}:1", 3)
        named = [(s["host"], s["link_gbps"], s["others_median_gbps"]) for s in data["slow_hosts"]]
        ok = (len(named) == 1 and named[0][0] == c and named[0][1] < 1.25 * SLOW_GBIT
              and named[0][2] > 0.75 * LINK_GBIT)
        if ok:
            assert f"warning: host {c}: link to the others measured " in text, text
            assert "a slow or misconfigured NIC?" in text, text
        return ok, f"named {named}, expected {c} at {SLOW_GBIT} against {LINK_GBIT} Gbit/s; {data['directed_gbps']}"

    with rates(cluster, **{c: str(SLOW_GBIT)}):
        _twice(measure)
