"""bench recovery --live's live contender on the local cluster: one short run under ``scripts/cluster.sh ftmpirun``,
its kill read from the victim's log and the next step from rank 0's metrics (the rounds, the restarts and the table are
tested on one process in tests/bench/test_recovery.py)."""

import os

import pytest
from mpi4py import MPI

from hpcnet.bench.recovery import _checked, _parser
from hpcnet.bench.recovery_live import JOB_ENVIRONMENT, measure_live
from hpcnet.bench.recovery_restart import job_options
from tests.helpers.live import ftmpi

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts mpirun on the local cluster; serial "
                                                                       "pass")]


def test_the_live_contender_times_a_kill_on_the_second_host_to_the_survivors_next_step(cluster, tmp_path,
                                                                                         monkeypatch):
    from hpcnet.data.synthetic import generate_images

    ftmpi()  # skips where set-up could not install the fault-tolerant MPI
    for name, value in JOB_ENVIRONMENT.items():  # as main_live sets them, undone after the test
        monkeypatch.setenv(name, os.environ.get(name, value))
    data = tmp_path / "tiny.h5"
    generate_images(data, num_train=384, num_eval=24, shape=(1, 8, 8), num_classes=4, seed=11)
    parser = _parser()
    args = parser.parse_args(["--live", "--steps", "12", "--every-steps", "4", "--kill-at", "7",
                              f"data.dataset={data}", "model.options.hidden=[32]", "dist.probe=false"])
    _checked(parser, args)
    result = measure_live(tmp_path, "live-0", job_options(args, settle=False), args)
    assert result["lost"] == [{"rank": 3, "host": cluster.hostnames[1]}] and result["state"] == "memory", result
    assert (result["world_size_after"], result["steps_recomputed"], result["next_step"]) == (3, 0, 8), result
    assert 0 < result["kill_to_next_step_s"] < 120 and result["kill_to_new_step_s"] == result["kill_to_next_step_s"]
    assert 0 < result["step_time_before_s"] < 30 and 0 <= result["shrink_s"] < result["kill_to_next_step_s"]
