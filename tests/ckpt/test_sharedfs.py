"""hpcnet.ckpt.sharedfs: every rank must see the one checkpoint directory."""

import pytest
import torch

from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.errors import UsageError
from tests.helpers.ckpt import save_steps
from tests.helpers.dirs import fresh_dir

pytestmark = pytest.mark.timeout(120)


@pytest.mark.mpi
def test_every_rank_must_see_the_same_checkpoints(comm, mpi_tmp_path, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("needs ranks that can disagree")
    import hpcnet.ckpt.sharedfs as shared

    directory = fresh_dir(comm, mpi_tmp_path / "node-local")
    with CheckpointManager(comm, directory, async_save=False) as manager:
        save_steps(manager, [1], {"model/w": torch.zeros(64, 256)})
        if comm.Get_rank() == 1:  # as a node-local directory on another node would look
            monkeypatch.setattr(shared, "listing", lambda folder: [])
        for attempt in (manager.start_fresh, lambda: manager.resume("auto")):
            with pytest.raises(UsageError, match=r"rank 1 on .* sees 0 committed checkpoint\(s\), rank 0 sees 1"):
                attempt()
    comm.Barrier()
