"""Elastic shrink and grow: slots and rank counts of mpirun and srun commands, the host probe, which side of a
partition is lost, and the supervisor's placement of the next attempt (the real thing: tests/test_cluster_elastic.py).
"""

import sys
import time
from pathlib import Path

import pytest

from hpcnet.launch.attempt import Attempt
from hpcnet.launch.cli import main
from hpcnet.launch.command import CommandError, parse_host_list, parse_hostfile, program_index, ranks_of
from hpcnet.launch.elastic import (
    ElasticError,
    HostWatch,
    check_template,
    fit_ranks,
    host_slots,
    lost_entries,
    place,
    probe_command,
    probe_hosts,
    run_probe,
    unreachable,
)
from hpcnet.launch.exclusion import ExcludedHosts
from hpcnet.launch.processes import reap_session
from hpcnet.launch.restarts import read_rank_places
from hpcnet.launch.supervisor import supervise
from hpcnet.paths import ready_dir

TRAIN = [sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", "train.steps=3"]
AGENT = ["--mca", "plm_rsh_agent", "/c/agent.sh", "-x", "PATH", "--allow-run-as-root"]


def _reap(sid: int) -> None:
    reap_session(sid, timeout_s=5)


def test_ranks_and_slots_of_mpirun_commands():
    cmd = ["mpirun", *AGENT, "--host", "n1:2,n2:2,n3", "-np", "5", *TRAIN]
    assert ranks_of(cmd) == 5 and program_index(cmd) == len(AGENT) + 5
    assert host_slots(cmd) == [("n1", 2), ("n2", 2), ("n3", 1)]
    assert host_slots(cmd, excluded=["n2.cluster"]) == [("n1", 2), ("n3", 1)]
    assert ranks_of(["mpirun", "--np=3", *TRAIN]) == 3 and ranks_of(["mpirun", "-H", "a,b", *TRAIN]) is None
    # an -np after the program is the program's, not mpirun's
    assert ranks_of(["mpirun", "-n", "2", sys.executable, "prog.py", "-np", "7"]) == 2
    assert parse_host_list("a,a,b:3") == [("a", 2), ("b", 3)]
    assert parse_hostfile("# c\nn1 slots=4\nn2   # one slot\n\nn3 slots=2 max_slots=8\n") == \
        [("n1", 4), ("n2", 1), ("n3", 2)]
    files = {"hf": "n1 slots=2\nn2 slots=2\n"}
    assert host_slots(["mpirun", "--hostfile", "hf", *TRAIN], read_file=files.__getitem__, excluded=["n1"]) == \
        [("n2", 2)]
    alloc = [("c1", 4), ("c2", 4)]
    assert host_slots(["mpirun", "-np", "8", *TRAIN], allocation=alloc, excluded=["c2"]) == [("c1", 4)]
    assert host_slots(["srun", "-n", "8", *TRAIN], allocation=alloc, excluded=["c1"]) == [("c2", 4)]
    assert host_slots(["mpirun", "-np", "8", *TRAIN]) is None and host_slots(["aprun", "x"], allocation=alloc) is None
    for bad in (["mpirun", "-np", "four", *TRAIN], ["mpirun", "--host", "a:x", *TRAIN]):
        with pytest.raises(CommandError, match="cannot read"):
            ranks_of(bad) if "-np" in bad else host_slots(bad)


def test_fit_ranks_keeps_the_users_count_when_the_survivors_hold_it_and_never_goes_below_the_minimum():
    cmd = ["mpirun", "-np", "4", "--host", "a:2", *TRAIN]
    kept = fit_ranks(cmd, 4, [("a", 4), ("c", 2)], 2)
    assert kept.command == cmd and kept.ranks_after == 4
    shrunk = fit_ranks(cmd, 4, [("a", 2)], 2)
    assert shrunk.command[:3] == ["mpirun", "-np", "2"] and (shrunk.ranks_before, shrunk.ranks_after) == (4, 2)
    assert shrunk.line(["b"]) == "shrinking: 4 -> 2 rank(s) on a (without b); the run resumes at the smaller world size"
    with pytest.raises(ElasticError, match=r"the hosts left \(a\) hold 2 slot\(s\), fewer than --min-ranks 3"):
        fit_ranks(cmd, 4, [("a", 2)], 3)
    with pytest.raises(ElasticError, match=r"\(none\) hold 0 slot"):
        fit_ranks(cmd, 4, [], 1)


def test_probe_commands_use_the_launchers_own_way_to_reach_a_host():
    cmd = ["mpirun", *AGENT, "--host", "a:2,b:2", "-np", "4", "--map-by", "ppr:2:node", "--bind-to", "none", *TRAIN]
    assert probe_command(cmd, "b") == ["mpirun", *AGENT, "--bind-to", "none", "--host", "b:1", "-np", "1", "true"]
    assert probe_command(["srun", "-n", "8", "--exclude=b", *TRAIN], "b") == \
        ["srun", "-w", "b", "-N1", "-n1", "true"]
    assert probe_command(["aprun", "-n", "4", *TRAIN], "b") is None
    assert probe_command(["aprun", *TRAIN], "b", "ssh -o ConnectTimeout=3 {host} true") == \
        ["ssh", "-o", "ConnectTimeout=3", "b", "true"]
    assert check_template("ping -c1 {host}")
    for bad, words in (("ping -c1 host", "must name the host as {host}"), ("", "empty"), ("'x {host}", "cannot")):
        with pytest.raises(ElasticError, match=words):
            check_template(bad)


def test_a_partition_excludes_only_the_host_that_does_not_answer():
    # each side of a partition names the other: the probe decides
    assert unreachable(["b", "a"], {"a": True, "b": False}) == \
        (["b"], "b did not answer the probe; a answered it (kept)")
    assert unreachable(["a", "b"], {"a": True, "b": True})[0] == []
    assert unreachable(["a", "b"], {"a": False, "b": False})[0] == ["a", "b"]
    assert unreachable(["b"], None) == (["b"], "named by the failure (no probe for this launcher)")


@pytest.mark.timeout(60)
def test_a_probe_that_hangs_is_killed_at_its_timeout_with_its_children(tmp_path):
    pid_file = tmp_path / "child"
    hang = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    t0 = time.monotonic()
    assert not run_probe(hang, 0.5, None, _reap)
    assert time.monotonic() - t0 < 20
    child = int(pid_file.read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert run_probe(["true"], 5, None, _reap) and not run_probe(["false"], 5, None, _reap)
    assert not run_probe([str(tmp_path / "no-such-launcher")], 5, None, _reap)
    flags = {"a": "true", "b": "false"}
    assert probe_hosts(["a", "b"], lambda h: [flags[h]], 5, None, _reap) == {"a": True, "b": False}
    assert probe_hosts(["a"], lambda h: None, 5, None, _reap) is None


@pytest.mark.timeout(60)
def test_the_host_watch_reports_a_host_that_answers_again_without_blocking(tmp_path):
    back = tmp_path / "b-is-back"
    watch = HostWatch(["b"], lambda h: ["test", "-e", str(back)], every_s=0.1, timeout_s=5, env=None,
                      reap=_reap).start()
    try:
        time.sleep(0.5)
        assert not watch.answered.is_set() and watch.back == []
        back.touch()
        assert watch.answered.wait(10) and watch.back == ["b"] and watch.answered_unix is not None
    finally:
        t0 = time.monotonic()
        watch.stop()
        assert time.monotonic() - t0 < 10 and not watch.thread.is_alive()


def _hosts(tmp_path: Path, command: list[str], allocation=None, launcher: str = "") -> ExcludedHosts:
    return ExcludedHosts(command, launcher=launcher or command[0], allocation=allocation, launch_dir=tmp_path)


def test_the_supervisor_shrinks_to_the_survivors_and_grows_back(tmp_path):
    cmd = ["mpirun", *AGENT, "--host", "a:2,b:2", "-np", "4", *TRAIN]
    hosts = _hosts(tmp_path, cmd)
    assert hosts.configure(2) is None and hosts.ranks == 4
    assert hosts.place(["b"], 1) is None
    assert ranks_of(hosts.command) == 2 and "a:2" in hosts.command and hosts.excluded == ["b"]
    assert hosts.place([], 1) is None and hosts.command == cmd and hosts.excluded == []
    # nobody left: the command cannot carry the exclusion, so no attempt follows (it would run there again)
    assert hosts.place(["a", "b"], 1) == ("not excluding a, b: no host would be left: not starting another attempt "
                                          "that would run there again") and hosts.command == cmd
    assert hosts.configure(3) is None
    assert hosts.place(["b"], 1) == "cannot run without b: the hosts left (a) hold 2 slot(s), fewer than --min-ranks 3"
    # a hostfile: the filtered one is written for the next attempt
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\nc slots=1\n")
    hosts = _hosts(tmp_path, ["mpirun", "--hostfile", str(hostfile), *TRAIN])
    assert hosts.configure(1) is None and hosts.ranks == 5
    assert hosts.place(["a"], 1) is None
    assert ranks_of(hosts.command) == 3
    written = hosts.command[hosts.command.index("--hostfile") + 1]
    assert Path(written).read_text() == "b slots=2\nc slots=1\n"
    # srun in an allocation
    hosts = _hosts(tmp_path, ["srun", "-n", "8", *TRAIN], allocation=[("n1", 4), ("n2", 4)])
    assert hosts.configure(4) is None and hosts.place(["n2"], 1) is None
    assert hosts.command[:4] == ["srun", "--exclude=n2", "-n", "4"]


def test_a_partition_leaves_out_the_launchers_entry_of_the_host_its_ranks_named(tmp_path):
    """The ranks call their hosts hh1 and hh2, names the launching host cannot resolve; the launcher lists their
    addresses.  After hh2's link is cut both sides name each other: the supervisor maps each to its entry by the
    addresses their ranks reported, probes the entries (not the names), and leaves out the one that does not
    answer, in the command the next attempt runs."""
    cmd = ["mpirun", *AGENT, "--host", "10.78.0.1:2,10.78.0.2:2", "-np", "4", *TRAIN]
    hosts = _hosts(tmp_path, cmd)
    hosts.probe_template = "test {host} = 10.78.0.1"  # only 10.78.0.1 answers
    ready = ready_dir(tmp_path, 1)
    ready.mkdir()
    for rank, (host, address) in enumerate([("hh1", "10.78.0.1")] * 2 + [("hh2", "10.78.0.2")] * 2):
        (ready / f"ready.{rank}").write_text(f"4 {100 + rank} 1.0 {host} {address},172.17.0.1 -\n")
    failure = {"kind": "heartbeat", "failed": [{"rank": 0, "host": "hh1"}, {"rank": 2, "host": "hh2"}]}
    record = Attempt(attempt=1, command=cmd, run_dir=str(tmp_path / "attempt-1"), start_unix=0.0, failure=failure)
    assert hosts.exclude_failed(record, [record]) is None
    assert hosts.excluded == ["10.78.0.2"] and "10.78.0.1:2" in hosts.command
    assert "10.78.0.1:2,10.78.0.2:2" not in hosts.command
    # the same through the pure step, and what is said
    probe = {"10.78.0.1": True, "10.78.0.2": False, "hh1": False, "hh2": False}
    places = read_rank_places(ready, "ready").values()
    lost, said, final = lost_entries(["hh1", "hh2"], ["10.78.0.1", "10.78.0.2"], places, excluded=[],
                                     resolve=lambda names: {}, probe=lambda hosts: {h: probe[h] for h in hosts})
    assert (lost, final) == (["10.78.0.2"], None)
    assert said == ("the failure names hh1 (the launcher's 10.78.0.1: an address its ranks reported), hh2 (the "
                    "launcher's 10.78.0.2: an address its ranks reported): 10.78.0.2 did not answer the probe; "
                    "10.78.0.1 answered it (kept)")
    # nothing joins a host to an entry (no report names its address): said, and no attempt follows
    lost, said, final = lost_entries(["hh2"], ["10.78.0.1", "10.78.0.2"], [], excluded=[],
                                     resolve=lambda names: {}, probe=lambda hosts: {h: probe[h] for h in hosts})
    assert lost == [] and said == "the failure names hh2 (no entry of the launcher's): hh2 did not answer the probe"
    assert final == ("cannot leave out hh2: no entry of the launcher's host list (10.78.0.1, 10.78.0.2) is it (by its "
                     "name, the scheduler's name for it or an address its ranks reported), and it does not answer "
                     "the probe; not starting another attempt that would run there again")
    hosts = _hosts(tmp_path, cmd)
    hosts.probe_template = "test {host} = 10.78.0.1"
    record = Attempt(attempt=1, command=cmd, run_dir=None, start_unix=0.0, failure={"rank": 2, "host": "hh2"})
    assert hosts.exclude_failed(record, []) == final and hosts.command == cmd and hosts.excluded == []
    # a host that answers needs no entry: a rank the OOM killer took leaves its host usable
    assert lost_entries(["hh1"], ["10.78.0.1"], [], excluded=[], resolve=lambda names: {},
                        probe=lambda hosts: dict.fromkeys(hosts, True))[::2] == ([], None)


def test_place_says_what_it_did_in_one_line():
    cmd = ["mpirun", "--host", "a:2,b:2,c:2", "-np", "6", *TRAIN]
    common = {"allocation": None, "read_file": lambda p: "", "hostfile_path": "hf"}
    shrunk = place(cmd, ["c"], min_ranks=2, ranks=6, ranks_now=6, **common)
    assert shrunk.note == ("excluding c: mpirun --host a:2,b:2; shrinking: 6 -> 4 rank(s) on a, b (without c); the run "
                           "resumes at the smaller world size") and shrunk.error is None
    partly = place(cmd, ["c"], min_ranks=2, ranks=6, ranks_now=2, **common)  # b came back, c is still out
    assert partly.note.endswith("shrinking: 6 -> 4 rank(s) on a, b (without c); the run resumes at the smaller "
                                "world size (from 2 rank(s) now: 2 -> 4)")
    back = place(cmd, [], min_ranks=2, ranks=6, ranks_now=4, **common)
    assert back.command == cmd and back.note == ("every host is back: 6 rank(s) on the full host list (4 -> 6 ranks); "
                                                 "the run resumes at the full world size")
    kept = place(cmd, ["c"], min_ranks=None, ranks=0, ranks_now=None, **common)
    assert ranks_of(kept.command) == 6 and kept.note == "excluding c: mpirun --host a:2,b:2"
    short = place(cmd, ["b", "c"], min_ranks=3, ranks=6, ranks_now=6, **common)
    assert short.command == cmd and short.error == ("cannot run without b, c: the hosts left (a) hold 2 slot(s), fewer "
                                                 "than --min-ranks 3")


def test_a_site_wrapper_of_a_launcher_runs_elastically_once_its_kind_is_declared(tmp_path, capsys):
    """TACC's ibrun, mpiexec.hydra, a site's mpirun: the name says nothing; --launcher-kind says whose options the
    command takes, and every rewrite follows it."""
    wrapper = ["site-mpirun", *AGENT, "--host", "a:2,b:2", "-np", "4", *TRAIN]
    assert ranks_of(wrapper) is None and ranks_of(wrapper, "mpirun") == 4
    assert host_slots(wrapper, kind="mpirun") == [("a", 2), ("b", 2)]
    assert probe_command(wrapper, "b") is None
    assert probe_command(wrapper, "b", kind="mpirun") == ["site-mpirun", *AGENT, "--host", "b:1", "-np", "1", "true"]
    assert probe_command(["ibrun", "-n", "8", *TRAIN], "b", kind="srun") == ["ibrun", "-w", "b", "-N1", "-n1", "true"]
    hosts = _hosts(tmp_path, wrapper, launcher="mpirun")
    assert hosts.configure(2) is None and hosts.ranks == 4
    assert hosts.place(["b"], 1) is None and hosts.command[:len(AGENT) + 5] == ["site-mpirun", *AGENT, "--host", "a:2",
                                                                       "-np", "2"]
    # undeclared: both options are refused at the start, saying how to declare it
    for min_ranks in (None, 2):
        assert supervise(wrapper, exclude_failed_hosts=True, min_ranks=min_ranks, standby="off") == 2
        err = capsys.readouterr().err
        assert "needs an mpirun or srun command" in err and "--launcher-kind mpirun|srun" in err, err
        assert "'site-mpirun'" in err and "Traceback" not in err
    # a kind that is not one is refused by name
    with pytest.raises(SystemExit) as exited:
        main(["--launcher-kind", "aprun", "--exclude-failed-hosts", "--", *wrapper])
    assert exited.value.code == 2
    assert "--launcher-kind: invalid choice: 'aprun' (choose from 'mpirun', 'srun')" in capsys.readouterr().err


def test_min_ranks_that_cannot_hold_is_a_usage_error(tmp_path, capsys):
    for argv, words in ((["--min-ranks", "2", "--", "mpirun", "-np", "2", "true"], "needs --exclude-failed-hosts"),
                        (["--exclude-failed-hosts", "--min-ranks", "0", "--", "mpirun", "true"], "at least 1"),
                        (["--exclude-failed-hosts", "--min-ranks", "x", "--", "mpirun", "true"], "invalid int"),
                        (["--probe-command", "true", "--", "mpirun", "true"], "must name the host as {host}"),
                        (["--probe-every-s", "0", "--", "mpirun", "true"], "--probe-every-s must be")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and words in capsys.readouterr().err, argv
    for cmd, words in ((["mpirun", "-np", "2", "true"], "--min-ranks 4 is more than the 2 rank(s) the command runs"),
                       (["mpirun", "true"], "names no number of ranks"),
                       (["sh", "-c", "true"], "needs an mpirun or srun command")):
        assert supervise(cmd, exclude_failed_hosts=True, min_ranks=4, standby="off") == 2, cmd
        assert words in capsys.readouterr().err, cmd

