"""What each attempt runs: the pinned directories, --resume auto, the attempt variable, the launcher's environment."""

from hpcnet.launch.command import (
    SIGKILL_TIMEOUT_ENV,
    attempt_command,
    launcher_env,
    launcher_kind,
    resume_args,
    train_args_start,
)

TRAIN = ["mpirun", "-np", "2", "python", "-m", "mpi4py", "-m", "hpcnet.train"]


def test_resume_flag_is_added_once_from_the_second_attempt():
    base = [*TRAIN, "run.name=x", "train.steps=5"]
    pinned = ["run.dir=/r/attempt-2", "run.dir_exact=true", "checkpoint.dir=/r/x.ckpt"]
    first = attempt_command(base, 1, train_start=len(TRAIN), pinned=pinned, openmpi=False)
    assert first == base + pinned
    second = attempt_command(base, 2, train_start=len(TRAIN), pinned=pinned, openmpi=False)
    assert second == base + pinned + ["--resume", "auto"]
    assert resume_args(second[len(TRAIN):]) == []  # a third attempt adds nothing more
    for already in (["--resume", "auto"], ["--resume=auto"], ["checkpoint.resume=auto"]):
        cmd = attempt_command(base + already, 3, train_start=len(TRAIN), pinned=[], openmpi=False)
        assert cmd == base + already
    # an explicit checkpoint is where the *first* attempt starts; restarts take the newest one
    explicit = attempt_command(base + ["--resume", "/c/ckpt-5.h5"], 2, train_start=len(TRAIN), pinned=[],
                               openmpi=False)
    assert explicit[-2:] == ["--resume", "auto"]


def test_attempt_number_is_exported_to_remote_ranks_by_open_mpi_only():
    cmd = attempt_command(TRAIN, 1, train_start=len(TRAIN), pinned=[], openmpi=True)
    assert cmd[:7] == ["mpirun", "-x", "HPCNET_ATTEMPT", "-x", "HPCNET_READY", "-x", "HPCNET_LAUNCH_ID"]
    assert cmd[7:] == TRAIN[1:]  # the token with the attempt: the checkpoint directory's fence
    other = ["mpirun", "-np", "2", "python", "job.py"]  # not hpcnet.train: no readiness reports
    assert attempt_command(other, 1, train_start=None, pinned=[], openmpi=True) == ["mpirun", "-x", "HPCNET_ATTEMPT",
                                                                                    *other[1:]]
    srun = ["srun", "-n", "2", "python", "-m", "hpcnet.train"]
    assert attempt_command(srun, 1, train_start=len(srun), pinned=[], openmpi=True) == srun


def test_open_mpi_ends_a_failed_job_without_grace_period():
    assert launcher_env({"A": "1"}, openmpi=True) == {"A": "1", SIGKILL_TIMEOUT_ENV: "0"}
    assert launcher_env({SIGKILL_TIMEOUT_ENV: "3"}, openmpi=True)[SIGKILL_TIMEOUT_ENV] == "3"
    assert launcher_env({"A": "1"}, openmpi=False) == {"A": "1"}


def test_where_train_arguments_start():
    assert train_args_start([*TRAIN, "a=1"]) == len(TRAIN)
    assert train_args_start(["srun", "hpcnet-train", "a=1"]) == 2
    assert train_args_start(["mpirun", "python", "myscript.py"]) is None


def test_launcher_kinds():
    assert launcher_kind(["/usr/bin/mpiexec", "-n", "2"]) == "mpirun" and launcher_kind(["srun", "x"]) == "srun"
    assert launcher_kind(["aprun", "x"]) == "" and launcher_kind([]) == ""
