"""The checkpoint benchmark: its round-by-round ratios, and a quick functional run under mpirun (no timing
assertions)."""

import json
import re

import pytest


def test_checkpoint_ratios_round_by_round():
    from hpcnet.bench.checkpoint import paired

    results = {"ours_all_s": [1.0, 2.0, 1.0, 4.0], "peer_all_s": [2.0, 1.0, 1.5, 4.0]}
    assert paired(results, "ours", "peer") == (1.25, 0.5, 2.0)  # ratios 2, 0.5, 1.5, 1 round by round


@pytest.mark.launch
def test_checkpoint_under_mpirun(launch, tmp_path):
    from hpcnet.bench.checkpoint import PAIRS

    out = tmp_path / "checkpoint.json"
    proc = launch(2, "checkpoint", "--size-mb", "8", "--repeat", "2", "--dir", str(tmp_path / "scratch"),
                  "--json", str(out), module="hpcnet.bench", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["world_size"] == 2 and results["rounds"] == 2 and results["state_bytes"] >= 7_000_000
    for name in ("disk_n_writers", "disk_n_readers", "hpcnet_save", "hpcnet_load", "hpcnet_load_into", "dcp_save",
                 "dcp_load", "h5py_collective"):
        assert len(results[f"{name}_all_s"]) == 2 and results[f"{name}_s"] == min(results[f"{name}_all_s"]) > 0
    assert "disk, N readers" in proc.stdout and "x disk N read" in proc.stdout
    for ours, _, peer in PAIRS:
        assert re.search(rf"{ours} +x {peer} +\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", proc.stdout), proc.stdout
    assert not (tmp_path / "scratch").exists()  # removed without --keep
