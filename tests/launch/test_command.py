"""The launcher's command line: what each attempt runs (the pinned directories, where a restart resumes, the
attempt variable, the launcher's environment) and its options rewritten."""

from hpcnet.config.load import load_config
from hpcnet.launch.command import (
    SIGKILL_TIMEOUT_ENV,
    attempt_command,
    launcher_env,
    launcher_kind,
    restart_args,
    restart_from,
    set_ranks,
    train_args_start,
)
from hpcnet.launch.job import prepare

TRAIN = ["mpirun", "-np", "2", "python", "-m", "mpi4py", "-m", "hpcnet.train"]
PROGRAM = TRAIN[3:]


def test_restarts_resume_from_the_newest_checkpoint_from_the_second_attempt():
    base = [*TRAIN, "run.name=x", "train.steps=5"]
    pinned = ["run.dir=/r/attempt-2", "run.dir_exact=true", "checkpoint.dir=/r/x.ckpt"]
    restart = restart_args("", own=True)
    assert restart == ["--resume", "auto"]
    first = attempt_command(base, 1, train_start=len(TRAIN), pinned=pinned, openmpi=False, restart=restart)
    assert first == base + pinned
    second = attempt_command(base, 2, train_start=len(TRAIN), pinned=pinned, openmpi=False, restart=restart)
    assert second == base + pinned + ["--resume", "auto"]
    assert restart_args("auto", own=True) == []  # the user's own --resume auto (and resume_else) says it all


def test_a_restart_of_a_run_that_began_from_a_checkpoint_falls_back_to_it_until_the_run_has_its_own():
    # the newest checkpoint of the run's own directory, else the one the first attempt started from
    assert restart_args("/c/ckpt-5.h5", own=True) == ["--resume", "auto", 'checkpoint.resume_else="/c/ckpt-5.h5"']
    assert restart_from("/c/ckpt-5.h5", own=True) == "from the newest checkpoint, else from /c/ckpt-5.h5"
    # a path that would read as a number or a boolean stays the path it is
    tricky = restart_args("1e3", own=True)[-1]
    assert load_config(overrides=["checkpoint.resume=auto", tricky]).checkpoint.resume_else == "1e3"
    # the directory held checkpoints before the supervisor started: restarts start as the first attempt did (its
    # refusal, or checkpoint.move_aside, applies), until an attempt has committed one
    for resume in ("", "/c/ckpt-5.h5"):
        assert restart_args(resume, own=False) == []
        assert restart_from(resume, own=False).startswith("as the first attempt did")


def test_the_supervisor_reads_where_the_run_starts_as_hpcnet_train_does(tmp_path, monkeypatch):
    """--resume, checkpoint.resume=, --checkpoint.resume V and a --config file: what hpcnet.train resolves."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text('[checkpoint]\nresume = "/c/from-file.h5"\n')
    cases = ((["--resume", "/c/a.h5"], "/c/a.h5"), (["checkpoint.resume=/c/b.h5"], "/c/b.h5"),
             (["--checkpoint.resume", "/c/c.h5"], "/c/c.h5"), (["--config", str(config)], "/c/from-file.h5"),
             (["--config", str(config), "--resume=auto"], "auto"), ([], ""))
    for args, resume in cases:
        job = prepare([*TRAIN, "run.name=x", f"run.dir={tmp_path}", *args], {})
        assert job.resume == resume and job.own, args
    (tmp_path / "x.ckpt").mkdir()
    (tmp_path / "x.ckpt" / "ckpt-0000000004.h5").write_bytes(b"")
    assert not prepare([*TRAIN, "run.name=x", f"run.dir={tmp_path}"], {}).own


def test_a_command_that_only_prints_is_not_supervised_as_a_run(tmp_path, monkeypatch):
    """--help, --print-config and --help-config train nothing and write no summary.json, whose absence after a
    status 0 otherwise means that the run did not finish (hpcnet.launch.attempt.unfinished)."""
    monkeypatch.chdir(tmp_path)
    for flag in ("--help", "--print-config", "--help-config"):
        assert prepare([*TRAIN, flag], {}).train_start is None, flag


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
    assert launcher_kind(["scripts/ftmpirun", "-np", "2"]) == "mpirun"  # mpirun's options, passed on as they are


def test_set_ranks_rewrites_np_and_n_or_adds_them():
    assert set_ranks(["mpirun", "-np", "4", "--host", "a:2", *PROGRAM], 2)[:3] == ["mpirun", "-np", "2"]
    assert set_ranks(["mpirun", "--np=4", *PROGRAM], 2)[1] == "--np=2"
    assert set_ranks(["mpirun", "--host", "a:2", *PROGRAM], 2)[:3] == ["mpirun", "-np", "2"]
    assert set_ranks(["srun", "--ntasks=8", "-N", "2", *PROGRAM], 4, nodes=1)[:4] == ["srun", "--ntasks=4", "-N", "1"]
    assert set_ranks(["srun", "--nodes=4", *PROGRAM], 3, nodes=2)[:4] == ["srun", "-n", "3", "--nodes=2"]
    assert set_ranks(["srun", "-N", "1", "-n", "8", *PROGRAM], 4, nodes=1)[:5] == ["srun", "-N", "1", "-n", "4"]
