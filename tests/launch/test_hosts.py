"""Host lists and leaving failed hosts out: SLURM lists, srun --exclude, mpirun --host and hostfiles, and which entry
of the launcher's list a failed host is."""

from hpcnet.launch.hosts import (
    RankPlace,
    entries_naming,
    exclude_hosts,
    expand_nodelist,
    expand_tasks_per_node,
    resolve_all,
    same_host,
    slurm_allocation,
)


def test_slurm_host_lists():
    assert expand_nodelist("n[01-03,07],gpu5") == ["n01", "n02", "n03", "n07", "gpu5"]
    assert expand_nodelist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "4(x3)"}
    assert slurm_allocation(env) == [("n1", 4), ("n2", 4), ("n3", 4)]
    assert slurm_allocation({}) is None


def test_exclude_a_host_with_srun():
    cmd = ["srun", "-N", "2", "python", "-m", "hpcnet.train"]
    assert exclude_hosts(cmd, ["n3"]).command == ["srun", "--exclude=n3", *cmd[1:]]
    merged = exclude_hosts(["srun", "--exclude=n1", "-N", "2", "x"], ["n3"]).command
    assert merged == ["srun", "--exclude=n1,n3", "-N", "2", "x"]
    assert exclude_hosts(["srun", "-x", "n1", "x"], ["n2"]).command == ["srun", "-x", "n1,n2", "x"]


def test_exclude_a_host_with_mpirun():
    cmd = ["mpirun", "-np", "4", "--host", "n1:2,n2:2,n3:2", "python", "t.py"]
    assert exclude_hosts(cmd, ["n2"]).command == ["mpirun", "-np", "4", "--host", "n1:2,n3:2", "python", "t.py"]
    assert exclude_hosts(["mpirun", "-H", "n1.cluster,n2", "x"], ["n1"]).command == ["mpirun", "-H", "n2", "x"]
    alone = exclude_hosts(["mpirun", "--host", "n1:4", "x"], ["n1"])
    assert alone.command == ["mpirun", "--host", "n1:4", "x"] and "no host would be left" in alone.note
    # a hostfile: filtered into a new file
    files = {"hosts.txt": "# nodes\nn1 slots=2\nn2 slots=2\nn3 slots=2\n"}
    out = exclude_hosts(["mpirun", "--hostfile", "hosts.txt", "x"], ["n2"], read_file=files.__getitem__,
                        hostfile_path="/l/hostfile.attempt-2")
    assert out.command == ["mpirun", "--hostfile", "/l/hostfile.attempt-2", "x"]
    assert out.hostfile == "# nodes\nn1 slots=2\nn3 slots=2\n"
    # no host list: the SLURM allocation, less the failed host
    out = exclude_hosts(["mpirun", "-np", "4", "x"], ["n2"], allocation=[("n1", 2), ("n2", 2), ("n3", 2)])
    assert out.command == ["mpirun", "--host", "n1:2,n3:2", "-np", "4", "x"]
    nothing = exclude_hosts(["mpirun", "-np", "4", "x"], ["n2"])
    assert nothing.command == ["mpirun", "-np", "4", "x"] and "no --host" in nothing.note
    assert "not mpirun or srun" in exclude_hosts(["aprun", "x"], ["n2"]).note


def test_an_entry_of_the_list_that_names_no_failed_host_is_never_claimed_excluded():
    cmd = ["mpirun", "--host", "10.78.0.1:2,10.78.0.2:2", "-np", "4", "x"]
    assert exclude_hosts(cmd, ["10.78.0.2"]).command == ["mpirun", "--host", "10.78.0.1:2", "-np", "4", "x"]
    named = exclude_hosts(cmd, ["hh2"])  # a name the list does not hold: the command is left as it is, and says so
    assert named.command == cmd and named.note == "cannot exclude hh2: not in --host 10.78.0.1:2,10.78.0.2:2"
    files = {"hf": "n1 slots=2\nn2 slots=2\n"}
    out = exclude_hosts(["mpirun", "--hostfile", "hf", "x"], ["n3"], read_file=files.__getitem__)
    assert out.command == ["mpirun", "--hostfile", "hf", "x"]
    assert out.note == "cannot exclude n3: not in the hostfile hf"
    alloc = [("c1", 2), ("c2", 2)]
    for launcher in ("mpirun", "srun"):
        out = exclude_hosts([launcher, "x"], ["c3"], allocation=alloc)
        assert out.command == [launcher, "x"] and out.note == "cannot exclude c3: not a node of the SLURM allocation"
    # addresses are one host only when equal (their first parts are no short name)
    assert not same_host("10.78.0.1", "10.78.0.2") and same_host("n1.cluster", "n1") and same_host("a", "a")


def _no_resolver(names):
    raise AssertionError(f"resolved {names} where the reports said enough")


def test_a_failed_host_is_the_launchers_entry_that_its_ranks_reported():
    """Ranks name their host by gethostname(); launchers by an address, an InfiniBand alias, a fully qualified name
    or the scheduler's node name.  What the ranks reported at their start joins the two."""
    places = [RankPlace("hh1", ("10.78.0.1", "172.17.0.1")), RankPlace("hh2", ("10.78.0.2", "172.17.0.1")),
              RankPlace("hh2", ("10.78.0.2", "172.17.0.1"))]
    ips = ["10.78.0.1", "10.78.0.2"]
    assert entries_naming("hh2", ips, places, _no_resolver) == (["10.78.0.2"], "an address its ranks reported")
    assert entries_naming("10.78.0.2", ips, places, _no_resolver) == (["10.78.0.2"], "by name")
    # an address every host has (docker0) tells nothing
    assert entries_naming("hh2", ["172.17.0.1"], places, lambda names: {}) == ([], "")
    # an InfiniBand alias: resolved by the supervisor's host to the address the ranks reported on their IPoIB port
    aliases = {"node01-ib": ["192.168.10.1"], "node02-ib": ["192.168.10.2"]}
    ib = [RankPlace("node01", ("10.0.0.1", "192.168.10.1")), RankPlace("node02", ("10.0.0.2", "192.168.10.2"))]
    assert entries_naming("node02", list(aliases), ib, lambda names: {n: aliases[n] for n in names}) == \
        (["node02-ib"], "resolves to an address its ranks reported")
    # a fully qualified name, and the scheduler's own name for the node
    assert entries_naming("node02", ["node01.hpc.example", "node02.hpc.example"], ib, _no_resolver)[0] == \
        ["node02.hpc.example"]
    slurm = [RankPlace("gpu-a17.internal", ("10.1.0.17",), node="a17")]
    assert entries_naming("gpu-a17.internal", ["a16", "a17"], slurm, _no_resolver) == (["a17"], "by name")
    # no list to find it in (srun outside an allocation): the scheduler's name, else the host's own
    assert entries_naming("gpu-a17.internal", None, slurm, _no_resolver)[0] == ["a17"]
    assert entries_naming("hh2", None, places, _no_resolver)[0] == ["hh2"]
    # nothing joins them: said, not guessed
    assert entries_naming("hh3", ips, places, lambda names: {}) == ([], "")


def test_the_resolver_answers_within_its_time_for_every_name():
    found = resolve_all(["localhost", "no-such-host.invalid", "127.0.0.9"], timeout_s=10)
    assert "127.0.0.1" in found["localhost"] and found["no-such-host.invalid"] == [] and found["127.0.0.9"] == \
        ["127.0.0.9"]


def test_an_option_after_the_program_is_the_programs_not_the_launchers():
    """The launcher's options are read by one scanner (``hpcnet.launch.command.find_option``), which stops where the
    program starts: a ``--host`` or ``-x`` of the program's is left alone, as the slot count leaves it."""
    cmd = ["mpirun", "-np", "2", "python", "prog.py", "--host", "n1,n2"]
    out = exclude_hosts(cmd, ["n2"], allocation=[("n1", 2), ("n2", 2)])
    assert out.command == ["mpirun", "--host", "n1:2", "-np", "2", "python", "prog.py", "--host", "n1,n2"]
    srun = ["srun", "-n", "2", "python", "prog.py", "-x", "a"]
    assert exclude_hosts(srun, ["n3"]).command == ["srun", "--exclude=n3", *srun[1:]]
