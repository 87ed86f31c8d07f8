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


@pytest.mark.launch
def test_ddp_with_its_compression_hooks_are_contenders_too_and_a_sharded_contender_trains_as_ddp(launch, tmp_path):
    """--ddp-hooks: DDP with each hook is a contender. --dist zero=3 (the same run): hpcnet's contender steps its
    sharded optimizer and compares its weights once they are whole again (it read released parameters, a
    segfault, and stepped an optimizer the owners' gradients never reach)."""
    out = tmp_path / "hooks.json"
    proc = launch(2, "train", "--models", "mlp-small", "--batch-size", "4", "--steps", "2", "--rounds", "2",
                  "--warmup", "3", "--profile-steps", "0", "--no-local", "--ddp-hooks", "bf16,powersgd",
                  "--dist", "zero=3", "--json", str(out), module="hpcnet.bench", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (res,) = json.loads(out.read_text())["results"]
    assert list(res["contenders"]) == ["hpcnet", "ddp-gloo", "ddp-gloo-bf16", "ddp-gloo-powersgd4"]
    assert set(res["ratio_hpcnet_vs"]) == {"ddp-gloo-bf16", "ddp-gloo-powersgd4"}
    assert all(r["median"] > 0 for r in res["ratio_hpcnet_vs"].values())
    assert "hpcnet / ddp-gloo-powersgd4 samples/s" in proc.stdout
    assert res["max_param_diff_hpcnet_vs_ddp"] < 1e-4


def test_an_unknown_ddp_hook_is_a_usage_error():
    from hpcnet.bench.train import _parse_args

    with pytest.raises(SystemExit) as exc:
        _parse_args(["--ddp-hooks", "bf16,int3"])
    assert exc.value.code == 2
