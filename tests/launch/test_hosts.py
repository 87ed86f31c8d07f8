"""Host lists and leaving failed hosts out: SLURM lists, srun --exclude, mpirun --host and hostfiles."""

from hpcnet.launch.hosts import exclude_hosts, expand_nodelist, expand_tasks_per_node, slurm_allocation


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
