"""Live recovery across hosts: 2 hosts x 2 ranks of the local cluster under ``scripts/cluster.sh ftmpirun``
(Open MPI 5 with ULFM). A rank of the second host killed -9 mid-run is left behind: the 3 survivors, on both hosts,
shrink the job, build it again and end as the uninterrupted 4-rank run does, within rounding. The killed run is
sharded at stage 3 with mirrors (``fault.replicas=1``): the lost rank's shards come from its keeper on the first
host."""

import pytest
from mpi4py import MPI

from tests.helpers.cluster import CLUSTER
from tests.helpers.live import KILL_AT, STEPS, assert_close, final_tensors, ftmpi, run_job, summary, train_args

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                 reason="starts mpirun on the local cluster; serial pass")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hpcnet.data.synthetic import generate_images

    path = tmp_path_factory.mktemp("cluster-live-data") / "tiny.h5"
    generate_images(path, num_train=384, num_eval=24, shape=(1, 8, 8), num_classes=4, seed=11)
    return path


def test_a_rank_killed_on_the_second_host_is_left_behind_and_the_three_survivors_end_as_four_ranks_do(
        cluster, data, tmp_path):
    """Stage 3 and fault.replicas=1 (the uninterrupted run at stage 0): rank 3's keeper is rank 0, on the other host
    (the ring 0 -> 2 -> 1 -> 3 -> 0); the survivors go on at the kill's step from the mirrors."""
    ftmpi()  # skips where set-up could not install the fault-tolerant MPI
    launcher = [str(CLUSTER), "ftmpirun", "-np", "4"]
    reference = run_job(launcher, train_args(data, tmp_path / "runs", "ref"), tmp_path, timeout=240)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = run_job(launcher, train_args(data, tmp_path / "runs", "kill", f"fault.kill_at_step={KILL_AT}",
                                       "fault.only_attempt=1", "dist.zero=3", "fault.replicas=1"), tmp_path,
                  timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    [record] = summary(tmp_path / "runs", "kill")["recovery"]["recoveries"]
    second_host = cluster.hostnames[1]
    assert record["lost"] == [{"rank": 3, "host": second_host}] and record["world_size"] == 3, record
    assert record["state"] == "mirror" and record["recomputed_steps"] == 0 and record["resumed_step"] == KILL_AT, record
    assert summary(tmp_path / "runs", "kill")["recovery"]["mirror"]["worlds"][0]["keepers"] == [2, 3, 1, 0]
    assert f"lost rank 3 ({second_host}) at step {KILL_AT}: the 3 survivors shrank the job" in out.stderr
    assert f"training goes on at step {KILL_AT} from the mirrors" in out.stderr
    assert summary(tmp_path / "runs", "kill")["steps"] == STEPS
    assert_close(final_tensors(tmp_path / "runs", "kill"), final_tensors(tmp_path / "runs", "ref"))
