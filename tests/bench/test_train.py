"""The training benchmark: a quick functional run under mpirun (no timing assertions)."""

import json

import pytest


@pytest.mark.launch
def test_train_under_mpirun(launch, tmp_path):
    out = tmp_path / "train.json"
    proc = launch(2, "train", "--models", "mlp-small,resnet_tiny", "--batch-size", "4", "--steps", "2", "--rounds",
                  "2", "--warmup", "1", "--profile-steps", "2", "--json", str(out), module="hpcnet.bench",
                  timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hpcnet / DDP samples/s" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "train" and [r["model"] for r in report["results"]] == ["mlp", "resnet_tiny"]
    for res in report["results"]:
        assert set(res["contenders"]) == {"hpcnet", "ddp-gloo", "local"}
        assert res["contenders"]["hpcnet"]["samples_per_s"]["median"] > 0
        assert res["contenders"]["hpcnet"]["profile"]["exposed_comm_ms"] >= 0
        assert res["ratio_hpcnet_vs_ddp"]["median"] > 0 and isinstance(res["met"], bool)
        # Same weights, data and steps: both trainers end with (near) equal weights.
        assert res["max_param_diff_hpcnet_vs_ddp"] < 1e-4
