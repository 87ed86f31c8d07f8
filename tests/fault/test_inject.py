"""Fault injection in the training loop: corrupt checkpoint, full disk, slow rank; the injector's choices.

In-process under MPI (any number of ranks); the faults that kill or stop a
process are tested through the supervisor in tests/launch/test_supervisor.py.
"""

import errno
import re
import signal

import pytest
import torch

from hpcnet.ckpt.damage import corrupt_newest
from hpcnet.ckpt.load import load_checkpoint
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.config import FaultConfig
from hpcnet.errors import ConfigError, ExitCode, UsageError, exit_code_of
from hpcnet.fault.inject import FaultInjector, current_attempt
from hpcnet.paths import ATTEMPT_ENV
from hpcnet.train import run
from hpcnet.world import World
from tests.helpers.data import tiny_images
from tests.helpers.train import StopAfter, train_config


def _world(rank=0, size=4):
    return World(rank=rank, size=size, local_rank=rank, local_size=size, node_index=0, num_nodes=1,
                 hostname="h", hostnames=("h",) * size, launcher="singleton", job_id="")


# --- the injector's decisions (pure) ------------------------------------------------------

def test_attempt_comes_from_the_environment():
    assert current_attempt({}) == 1
    assert current_attempt({ATTEMPT_ENV: "3"}) == 3
    with pytest.raises(ConfigError, match=ATTEMPT_ENV):
        current_attempt({ATTEMPT_ENV: "zero"})


@pytest.mark.parametrize("rank_opt, size, chosen", [(-1, 4, 3), (-2, 4, 2), (0, 4, 0), (-1, 1, 0)])
def test_the_chosen_rank(rank_opt, size, chosen):
    cfg = FaultConfig(kill_at_step=5, rank=rank_opt)
    picked = [r for r in range(size) if FaultInjector(cfg, _world(r, size), attempt=1).mine]
    assert picked == [chosen]


def test_a_rank_outside_the_job_is_a_config_error():
    with pytest.raises(ConfigError, match="fault.rank: 4 is not a rank of this 4-rank job"):
        FaultInjector(FaultConfig(kill_at_step=5, rank=4), _world(), attempt=1)


@pytest.mark.parametrize("only_attempt, attempt, active", [(0, 1, True), (0, 3, True), (1, 1, True), (1, 2, False),
                                                            (2, 2, True)])
def test_only_attempt(only_attempt, attempt, active):
    injector = FaultInjector(FaultConfig(slow_s=1.0, only_attempt=only_attempt, rank=0), _world(0), attempt=attempt)
    assert injector.mine is active and bool(injector.describe()) is active


def test_at_step_acts_at_its_step_only(monkeypatch):
    sent, slept = [], []
    monkeypatch.setattr("os.kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr("time.sleep", slept.append)
    cfg = FaultConfig(kill_at_step=4, hang_at_step=3, sleep_at_step=2, sleep_s=7.0, slow_s=0.5, rank=-1)
    FaultInjector(cfg, _world(0, 2), attempt=1).at_step(4)  # not the chosen rank
    assert sent == [] and slept == []
    injector = FaultInjector(cfg, _world(1, 2), attempt=1)
    for step in range(1, 6):
        injector.at_step(step)
    assert sent == [signal.SIGSTOP, signal.SIGKILL]
    assert slept == [0.5, 0.5, 7.0, 0.5, 0.5, 0.5]


def test_io_fault_hooks():
    assert FaultInjector(FaultConfig(), _world(), attempt=1).io_fault is None  # nothing armed: no hook
    hook = FaultInjector(FaultConfig(fill_disk_at_step=8), _world(), attempt=1).io_fault
    hook("precheck", 7)  # earlier saves still fit
    hook("write", 9)  # the full disk is found by the free-space check
    with pytest.raises(OSError) as info:
        hook("precheck", 8)
    assert info.value.errno == errno.ENOSPC and exit_code_of(info.value) == ExitCode.USAGE_ERROR
    cfg = FaultConfig(write_error="EIO", write_error_at_step=3, rank=-1)
    FaultInjector(cfg, _world(0, 2), attempt=1).io_fault("write", 5)  # not the chosen rank
    hook = FaultInjector(cfg, _world(1, 2), attempt=1).io_fault
    hook("write", 2)
    hook("read", 5)
    with pytest.raises(OSError) as info:
        hook("write", 3)
    assert info.value.errno == errno.EIO and exit_code_of(info.value) == ExitCode.RESTARTABLE
    with pytest.raises(ConfigError, match="fault.write_error"):
        FaultConfig(write_error="EBADF")


@pytest.mark.mpi
def test_corrupt_newest_is_caught_by_the_checksums(comm, mpi_tmp_path):
    directory = mpi_tmp_path / "corrupt-direct"
    tensors = {"model/w": torch.arange(64 * 300, dtype=torch.float32).reshape(64, 300)}
    with CheckpointManager(comm, directory, full_every=1, async_save=False) as manager:
        manager.save(1, tensors, {}, {})
        newest = manager.save(2, tensors, {}, {})
        what = corrupt_newest(directory) if comm.Get_rank() == 0 else ""
        what = comm.bcast(what, root=0)
        assert str(newest) in what and "tensors/model/w" in what
        loaded = manager.load("auto")
        assert loaded.step == 1 and len(loaded.skipped) == 1 and "checksum mismatch" in loaded.skipped[0]


# --- in the training loop -----------------------------------------------------------------

def _dataset(comm, tmp):
    return tiny_images(comm, tmp, "fault-images.h5", num_train=320, num_eval=32, seed=5)


def _cfg(tmp, dataset, name, *extra):
    return train_config(tmp, dataset, name, "run.name=faults", "train.steps=12", "checkpoint.every_steps=4",
                        "model.name=mlp", "model.options.hidden=[32]", "optim.name=sgd", *extra)


def _params(result):
    return [p.detach().clone() for p in result.model.parameters()]




@pytest.mark.mpi
def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(comm, data_plane, mpi_tmp_path):
    dataset = _dataset(comm, mpi_tmp_path)
    straight = run(_cfg(mpi_tmp_path, dataset, "corrupt-ref"), comm, plane=data_plane)
    first = run(_cfg(mpi_tmp_path, dataset, "corrupt"), comm, plane=data_plane, stop=StopAfter(8))
    assert first.summary["steps"] == 8  # checkpoints at steps 4 and 8
    second = run(_cfg(mpi_tmp_path, dataset, "corrupt", "checkpoint.resume=auto", "fault.corrupt_checkpoint=true",
                      f"run.dir={mpi_tmp_path / 'runs' / 'corrupt-2'}"), comm, plane=data_plane)
    assert second.summary["start_step"] == 4 and second.summary["steps"] == 12
    for a, b in zip(_params(straight), _params(second)):
        assert torch.equal(a, b)  # work since step 4 recomputed: the same result
    log = (mpi_tmp_path / "runs" / "corrupt-2" / "rank0.log").read_text()
    assert "fault injection: corrupted" in log and "ckpt-0000000008.h5" in log
    assert "skipping checkpoint" in log and "checksum mismatch" in log
    assert "ckpt-0000000004.h5 at step 4" in log and "skipped 1 unusable newer checkpoint" in log
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("async_save", [True, False])
def test_full_disk_is_a_clear_error_on_every_rank_and_keeps_what_was_committed(comm, data_plane, mpi_tmp_path,
                                                                                 async_save):
    dataset = _dataset(comm, mpi_tmp_path)
    name = f"full-{async_save}"
    with pytest.raises((OSError, UsageError)) as info:
        run(_cfg(mpi_tmp_path, dataset, name, "fault.fill_disk_at_step=8", f"checkpoint.async_save={async_save}"),
            comm, plane=data_plane)
    error = info.value  # rank 0 (which creates the file) raises the OSError, the others its UsageError echo
    assert isinstance(error, UsageError) or error.errno == errno.ENOSPC
    assert exit_code_of(error) == ExitCode.USAGE_ERROR  # not restartable: the disk stays full
    assert "No space left on device" in str(error) and "fill_disk_at_step=8" in str(error)
    assert re.search(r"ckpt-0000000008\.h5\.[0-9a-f]{16}\.tmp", str(error))
    directory = mpi_tmp_path / "ckpt" / name
    assert sorted(p.name for p in directory.iterdir()) == ["ckpt-0000000004.h5", "latest"]
    loaded = load_checkpoint(comm, "auto", directory)
    assert loaded.step == 4 and not loaded.skipped
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_slow_rank_is_not_a_failure(comm, data_plane, mpi_tmp_path):
    dataset = _dataset(comm, mpi_tmp_path)
    straight = run(_cfg(mpi_tmp_path, dataset, "slow-ref"), comm, plane=data_plane)
    slow = run(_cfg(mpi_tmp_path, dataset, "slow", "fault.slow_s=0.05", "fault.sleep_at_step=3", "fault.sleep_s=1.5"),
               comm, plane=data_plane)
    assert slow.exit_code == ExitCode.OK and slow.summary["steps"] == 12
    for a, b in zip(_params(straight), _params(slow)):
        assert torch.equal(a, b)
    comm.Barrier()


def test_a_kill_series_kills_at_each_of_its_steps_once_in_a_job_whatever_world_computes_it_again():
    """fault.kill_every_steps: the kill steps are 3, 7, 11...; a survivor's world that computes step 7 again (from a
    checkpoint) sees its kill done (the steps are kept across worlds by hpcnet.fault.live)."""
    killed: set[int] = set()
    cfg = FaultConfig(kill_at_step=3, kill_every_steps=4)
    first = FaultInjector(cfg, _world(0, 4), attempt=1, killed=killed)
    assert [s for s in range(1, 13) if first._kill_step(s)] == [3, 7, 11]
    again = FaultInjector(cfg, _world(0, 3), attempt=1, generation=1, killed=killed)
    assert [s for s in range(1, 16) if again._kill_step(s)] == [15]
    assert "and every 4 steps after" in first.describe()
    only_first = FaultConfig(kill_at_step=3, kill_every_steps=4, only_attempt=1)
    assert not FaultInjector(only_first, _world(0, 3), attempt=1, generation=1)._kill_step(7)
