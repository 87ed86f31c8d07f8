"""hpcnet.ckpt.fence: a stale attempt's commit is refused (nothing renamed, ``latest`` unmoved, nothing pruned), the
attempt that holds the fence commits, and a job without a supervisor is not fenced."""

import errno
import io

import pytest
import torch

from hpcnet.ckpt.fence import Fence, own_fence, read_fence, refusal, write_fence
from hpcnet.paths import FENCE_NAME
from tests.helpers.dirs import fresh_dir

pytestmark = pytest.mark.timeout(120)


def test_who_may_commit(tmp_path):
    mine = Fence("aaaa", 2)
    assert refusal(tmp_path, None) is None and refusal(tmp_path, mine) is None  # no supervisor; no fence yet
    write_fence(tmp_path, Fence("aaaa", 2), launch_dir="/x")
    assert read_fence(tmp_path) == mine and refusal(tmp_path, mine) is None
    assert refusal(tmp_path, Fence("aaaa", 3)) is None  # the fence's write not seen yet: never a newer attempt
    stale = refusal(tmp_path, Fence("aaaa", 1))
    assert stale and "attempt 2 of launch aaaa holds" in stale and "this rank is attempt 1" in stale
    assert refusal(tmp_path, Fence("cccc", 5))  # another supervisor's run holds the directory
    assert refusal(tmp_path, None) is None
    (tmp_path / FENCE_NAME).write_text("{not json")
    assert "cannot be read" in refusal(tmp_path, mine)
    assert [p.name for p in tmp_path.iterdir()] == [FENCE_NAME]  # no temporary file left


def test_own_fence_needs_the_supervisors_token_and_attempt():
    assert own_fence({}) is None
    assert own_fence({"HPCNET_ATTEMPT": "2"}) is None  # fault.only_attempt tried by hand: not fenced
    assert own_fence({"HPCNET_ATTEMPT": "2", "HPCNET_LAUNCH_ID": "ab"}) == Fence("ab", 2)
    assert own_fence({"HPCNET_ATTEMPT": "x", "HPCNET_LAUNCH_ID": "ab"}) is None


@pytest.mark.mpi
def test_a_stale_attempts_commit_is_refused_and_the_newer_ones_accepted(comm, mpi_tmp_path):
    from hpcnet.ckpt.manager import CheckpointManager
    from hpcnet.ckpt.tool import main as tool
    from hpcnet.errors import exit_code_of

    directory = fresh_dir(comm, mpi_tmp_path / "fenced")
    tensors = {"model/w": torch.arange(600.0).reshape(20, 30), "model/b": torch.ones(3)}
    with CheckpointManager(comm, directory, keep=1, full_every=1, async_save=True) as manager:
        manager.fence = Fence("run", 1)
        manager.save(1, tensors, {}, {})
        manager.wait()
        if comm.Get_rank() == 0:  # the supervisor gives attempt 1 up and starts attempt 2
            write_fence(directory, Fence("run", 2))
        comm.Barrier()
        manager.save(2, tensors, {}, {})  # attempt 1 goes on, cut off: its commit must not happen
        with pytest.raises(OSError) as info:
            manager.wait()
        comm.Barrier()
        names = sorted(p.name for p in directory.iterdir())
        latest = (directory / "latest").read_text()
    assert info.value.errno == errno.ESTALE and exit_code_of(info.value) == 75
    assert "refused: attempt 2 of launch run holds" in str(info.value)
    assert names == ["ckpt-0000000001.h5", FENCE_NAME, "latest"]  # no rename, no tmp left, nothing pruned
    assert latest == "ckpt-0000000001.h5\n"

    with CheckpointManager(comm, directory, keep=1, full_every=1, async_save=False) as manager:
        manager.fence = Fence("run", 2)
        assert manager.resume("auto").step == 1
        manager.save(3, {k: v + 1 for k, v in tensors.items()}, {}, {})
        comm.Barrier()
        names = sorted(p.name for p in directory.iterdir())
    assert names == ["ckpt-0000000003.h5", FENCE_NAME, "latest"]
    assert (directory / "latest").read_text() == "ckpt-0000000003.h5\n"
    if comm.Get_rank() == 0:
        out = io.StringIO()
        assert tool(["verify", str(directory)], out=out) == 0, out.getvalue()
        assert "ok     ckpt-0000000003.h5: step 3" in out.getvalue()
    comm.Barrier()
