"""The local multi-host cluster of scripts/cluster.sh: hosts as network namespaces on this machine.

scripts/test.sh starts the cluster before the serial pass and stops it after; run alone, this module starts
one itself (and stops it at the end) when none is running, and skips with the reason where namespaces cannot
be made (not root, ``ip netns add`` refused) or where HPCNET_CLUSTER=off and none is running.  Every job here
runs under ``scripts/cluster.sh mpirun`` or the options that ``scripts/cluster.sh env`` prints, as a user
runs it.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from mpi4py import MPI

from tests.helpers.cluster import CLUSTER, STATE, Cluster, cli
from tests.helpers.launch import clean_env, wait_for

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(180),
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts mpirun on the local cluster; serial pass"),
]

@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_start_says_why_it_cannot(tmp_path):
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(CLUSTER), "start"],
                         env=clean_env(HPCNET_CLUSTER_DIR=str(tmp_path / "state")), capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 1 and "not root: network namespaces need root" in out.stderr, out.stderr


def test_hosts_have_their_own_names_and_addresses(cluster, tmp_path):
    hosts = cluster.hostnames
    # Rank 0 prints for all: lines that several ranks print may interleave on mpirun's output.
    code = ("import socket\nfrom mpi4py import MPI\nname = socket.gethostname()\n"
            f"others = [socket.gethostbyname(h) for h in {hosts!r}]\n"
            "row = [MPI.COMM_WORLD.Get_rank(), name, MPI.Get_processor_name(), socket.gethostbyname(name), *others]\n"
            "rows = MPI.COMM_WORLD.gather(' '.join(map(str, row)))\n"
            "if rows: print('\\n'.join(rows))")
    lines = [line.split() for line in cluster.python(tmp_path, 4, code).splitlines() if line[:1].isdigit()]
    assert len(lines) == 4, lines
    for rank, name, processor, address, *others in lines:
        host = int(rank) // cluster.slots  # --host fills each host's slots in turn
        assert name == processor == hosts[host], lines
        assert address == cluster.addresses[host], lines  # a host's own name is its bridge address
        assert others == cluster.addresses[:len(hosts)], lines  # every name resolves on every host
    assert len({line[1] for line in lines}) == min(len(hosts), 4 // cluster.slots), lines


def test_allreduce_across_hosts_with_the_printed_options(cluster, tmp_path):
    # `mpirun $(scripts/cluster.sh env)`: the options a user copies, not the wrapper.
    options = cli("env").stdout.split()
    assert "plm_rsh_agent" in options and "--host" in options, options
    code = ("import socket\nimport numpy as np\nfrom mpi4py import MPI\ncomm = MPI.COMM_WORLD\n"
            "x = np.full(1 << 20, comm.Get_rank() + 1, dtype=np.float64)\ny = np.empty_like(x)\n"
            "comm.Allreduce(x, y)\nhosts = comm.allgather(socket.gethostname())\n"
            "sums = comm.gather((y.min(), y.max()))\n"
            "if sums: print('sum', min(s[0] for s in sums), max(s[1] for s in sums), len(set(hosts)))")
    out = subprocess.run(["mpirun", *options, "-np", "4", sys.executable, "-c", code], cwd=tmp_path,
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.findall(r"^sum (\S+) (\S+) (\d+)$", out.stdout, flags=re.M) == [("10.0", "10.0", "2")], out.stdout


def test_hostfile(cluster, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(cli("hosts").stdout)
    assert hostfile.read_text().split("\n")[0] == f"{cluster.hostnames[0]} slots={cluster.slots}"
    code = "import socket\nprint(socket.gethostname())"
    out = cluster.python(tmp_path, 2, code, "--hostfile", str(hostfile), "--map-by", "node")
    names = re.findall("|".join(map(re.escape, cluster.hostnames)), out)  # the two lines may come out interleaved
    assert sorted(names) == sorted(cluster.hostnames[:2]), out


def test_fail_kills_every_process_of_a_host(cluster, tmp_path):
    victim = cluster.hostnames[1]
    code = ("import os, time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
            f"open(os.path.join({str(tmp_path)!r}, f'up-{{MPI.COMM_WORLD.Get_rank()}}'), 'w').close()\n"
            "time.sleep(120)")
    job = subprocess.Popen([str(CLUSTER), "mpirun", "-np", "4", sys.executable, "-c", code], cwd=tmp_path,
                           env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: len(list(tmp_path.glob("up-*"))) == 4, 60), "the job did not start"
        assert len(cluster.pids(victim)) >= 3  # its daemon and two ranks
        cli("fail", victim)
        assert cluster.pids(victim) == []
        # mpirun sees its daemon die and ends the job, the ranks on the other host included.
        out, _ = job.communicate(timeout=60)
        assert job.returncode != 0, out
        assert wait_for(lambda: cluster.pids(cluster.hostnames[0]) == [], 10), cluster.pids(cluster.hostnames[0])
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def _ping(source: str, target: str) -> bool:
    return cli("exec", source, "ping", "-c", "1", "-W", "1", target, check=False).returncode == 0


def test_partition_and_heal(cluster):
    a, b = cluster.hostnames[:2]
    assert _ping(a, b)
    cli("partition", b)
    try:
        assert not _ping(a, b) and not _ping(b, a)
    finally:
        cli("heal", b)
    assert wait_for(lambda: _ping(a, b), 10)


def test_link_rate_is_a_tbf_qdisc_that_limits(cluster, tmp_path):
    def qdisc(host):
        ns = cluster.namespaces[cluster.hostnames.index(host)]
        return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", cluster.interface(host)],
                              capture_output=True, text=True, check=True).stdout

    before = {host: qdisc(host) for host in cluster.hostnames}
    a, b = cluster.hostnames[:2]
    # `start --link-gbit` on a running cluster sets the rate in place, on every host.
    cli("start", "--link-gbit", "0.1")
    try:
        assert all(re.search(r"tbf .* rate 100Mbit", qdisc(host)) for host in cluster.hostnames)
        # 4 MiB each way between two hosts at 100 Mbit/s: at least 0.34 s.
        code = ("import time\nimport numpy as np\nfrom mpi4py import MPI\ncomm = MPI.COMM_WORLD\n"
                "x = np.zeros(1 << 22, dtype=np.uint8)\ny = np.empty_like(x)\npeer = 1 - comm.rank\n"
                "comm.Sendrecv(x, peer, recvbuf=y)\nt = time.perf_counter()\ncomm.Sendrecv(x, peer, recvbuf=y)\n"
                "rates = comm.gather(x.nbytes * 8 / (time.perf_counter() - t) / 1e9)\n"
                "if rates: print(*(f'gbit {r}' for r in rates), sep='\\n')")
        out = cluster.python(tmp_path, 2, code, "--host", f"{a}:1,{b}:1")
        rates = [float(r) for r in re.findall(r"^gbit (\S+)$", out, flags=re.M)]
        assert len(rates) == 2 and all(0.01 < r < 0.12 for r in rates), out
        cli("slow", b, "2")
        assert "rate 2Gbit" in qdisc(b) and "rate 100Mbit" in qdisc(a)
    finally:
        cli("slow", "all", "off")
        for host, shown in before.items():
            rate = re.search(r"tbf .* rate (\S+)", shown)
            if rate:
                cli("slow", host, rate.group(1).lower())
    assert all(qdisc(host) == before[host] for host in cluster.hostnames)


def test_default_job_on_two_hosts_whose_interfaces_are_named_differently(cluster, tmp_path):
    """Each host picks its own interface towards rank 0 (a name forced from rank 0's host hung the rendezvous)."""
    before = cluster.config["ifnames"]
    cli("start", "--ifnames", "distinct")
    try:
        names = [Cluster().interface(h) for h in cluster.hostnames]
        assert len(set(names)) == len(names), names
        run = tmp_path / "run"
        out = cluster.mpirun(tmp_path, "-np", "4", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
                             "train.steps=10", "train.eval_every=0", "run.log_every=5", f"run.dir={run}",
                             "run.dir_exact=true", "dist.startup_timeout_s=60", timeout=150)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        assert re.search(r"4 ranks on 2 node\(s\) \(2 per node\), host\(s\) (\S+), (\S+)", out.stderr), out.stderr
        assert "done: 10 steps" in out.stderr, out.stderr[-3000:]
        log = (run / "rank0.log").read_text()
        (a, b), (ia, ib), (aa, ab) = cluster.hostnames[:2], names[:2], cluster.addresses[:2]
        assert f"network interface on {a} (ranks 0, 1): {ia} {aa} (holds {aa})" in log, log
        assert f"network interface on {b} (ranks 2, 3): {ib} {ab} (same subnet as {aa})" in log, log
        assert f"GLOO_SOCKET_IFNAME={ib}" in (run / "rank2.log").read_text()
        # Host names resolve on every host, peers' addresses back to names too (c10d warns otherwise).
        assert "hostname of the client socket cannot be retrieved" not in out.stderr, out.stderr[-3000:]
    finally:
        cli("start", "--ifnames", before)


def test_checkpoints_written_from_two_hosts_verify_and_resume_on_one_host_and_back(cluster, tmp_path):
    """ZeRO-2 (each rank writes its own optimizer-state rows) on two hosts, into one checkpoint on the shared file
    system: it verifies, a run on one host resumes from it at half the world size, and a run on two hosts again
    resumes from what the one host saved."""
    from tests.helpers.data import tiny_images

    dataset = tiny_images(MPI.COMM_SELF, tmp_path, "two-hosts.h5", num_train=96, num_eval=16, seed=5)
    a = cluster.hostnames[0]
    common = [sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", f"data.dataset={dataset}", "run.dir_exact=true",
              f"checkpoint.dir={tmp_path / 'ckpt'}", "model.name=mlp", "model.options.hidden=[16]",
              "train.batch_size=8", "train.eval_every=0", "run.log_every=1", "checkpoint.every_steps=3",
              "checkpoint.every_s=0", "dist.zero=2", "dist.probe=false", "dist.startup_timeout_s=60"]

    def leg(name, steps, *hosts, resume=True):
        out = cluster.mpirun(tmp_path, *hosts, *common, f"run.dir={tmp_path / name}", f"train.steps={steps}",
                             *(["--resume", "auto"] if resume else []), timeout=150)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        verify = subprocess.run([sys.executable, "-m", "hpcnet.ckpt", "verify", str(tmp_path / "ckpt")],
                                env=clean_env(), capture_output=True, text=True, timeout=60)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert f"step {steps}" in verify.stdout, verify.stdout
        return out.stderr, summary

    log, summary = leg("two", 6, "-np", "4", resume=False)
    assert "4 rank(s) on 2 node(s)" in log, log[-3000:]
    assert (summary["start_step"], summary["steps"], summary["world_size"]) == (0, 6, 4), summary
    log, summary = leg("one", 9, "--host", f"{a}:2", "-np", "2")
    assert "at step 6 (saved by 4 rank(s)" in log, log[-3000:]
    assert (summary["start_step"], summary["steps"], summary["world_size"]) == (6, 9, 2), summary
    log, summary = leg("back", 12, "-np", "4")
    assert "at step 9 (saved by 2 rank(s)" in log, log[-3000:]
    assert (summary["start_step"], summary["steps"], summary["world_size"]) == (9, 12, 4), summary


def test_stop_leaves_nothing_behind(cluster, tmp_path):
    """Last: stops the cluster (every process on it included), then starts it again as it was."""
    rates = {host: re.search(r"tbf \S+ rate (\S+)", line) for host, line in
             zip(cluster.hostnames, cli("status").stdout.splitlines()[1:])}
    sleeper = subprocess.Popen([str(CLUSTER), "exec", cluster.hostnames[0], "sleep", "300"], env=clean_env())
    assert wait_for(lambda: cluster.pids(cluster.hostnames[0]), 10)
    stop_started = time.monotonic()
    cli("stop")
    assert time.monotonic() - stop_started < 20
    assert sleeper.wait(timeout=10) != 0
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not set(cluster.namespaces) & set(netns), netns
    bridge = f"{cluster.config['prefix']}br0"
    assert not re.search(rf"^\d+: ({bridge}|v-{cluster.config['prefix']}[a-z])[@:]", links, flags=re.M), links
    assert not STATE.exists()
    assert cli("status", check=False).returncode == 1
    cli("start", "--hosts", cluster.config["hosts"], "--slots", str(cluster.slots),
         "--ifnames", cluster.config["ifnames"])
    for host, rate in rates.items():
        if rate:
            cli("slow", host, rate.group(1).lower())
