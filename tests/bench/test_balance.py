"""bench balance: the steady-rate arithmetic, and one quick round under mpirun (no timing assertions)."""

import json
import subprocess
import sys

import pytest
from mpi4py import MPI

from hpcnet.bench.balance import steady_rate
from tests.helpers.data import tiny_images
from tests.helpers.launch import clean_env


def test_steady_rate_counts_the_intervals_after_the_warm_up(tmp_path):
    path = tmp_path / "metrics.rank0.jsonl"
    lines = [{"step": 5, "samples_per_s": 10.0}, {"step": 10, "samples_per_s": 100.0}, {"step": 10, "eval_loss": 1},
             {"step": 15, "samples_per_s": 200.0}, {"step": 20, "samples_per_s": 50.0}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # Intervals 10-15 and 15-20, 40 samples each at global batch 8: 80 samples in 0.2 + 0.8 s.
    assert steady_rate(path, 8, after_step=10) == pytest.approx(80.0)
    with pytest.raises(RuntimeError, match="no log interval after step 20"):
        steady_rate(path, 8, after_step=20)


def test_one_round_under_mpirun(tmp_path):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpirun; runs in the serial pass")
    dataset = tiny_images(MPI.COMM_SELF, tmp_path, "images.h5", num_train=512, num_eval=16, seed=1)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hpcnet.bench", "balance", "--rounds", "1", "--steps", "14", "--every", "3",
         "--log-every", "2", "--slow-ms", "10", "--dir", str(tmp_path / "runs"), "--json", str(out),
         f"data.dataset={dataset}", "model.name=mlp", "train.batch_size=8", "dist.probe=false"],
        env=clean_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "auto/off:" in proc.stdout and "auto's last decision" in proc.stdout
    result = json.loads(out.read_text())
    auto = result["rounds"][0]["auto"]
    assert sum(auto["sizes"]) == 16 and auto["sizes"][1] < 8  # the slow rank was given fewer samples
    assert result["rounds"][0]["off"]["sizes"] is None and len(result["ratio_auto_over_off"]) == 1
