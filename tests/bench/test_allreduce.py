"""The all-reduce benchmark: a quick functional run under mpirun (no timing assertions)."""

import json

import pytest


@pytest.mark.launch
def test_allreduce_under_mpirun(launch, tmp_path):
    out = tmp_path / "allreduce.json"
    proc = launch(2, "allreduce", "--max-size", "64KiB", "--iters", "2", "--rounds", "2", "--warmup", "1",
                  "--json", str(out), module="hpcnet.bench", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "load average" in proc.stdout and "mpi/mpi4py" in proc.stdout and "target:" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "allreduce" and report["environment"]["world_size"] == 2
    names = {m["name"] for m in report["methods"]}
    peers = {m["name"]: m["peer"] for m in report["methods"]}
    assert {"mpi4py", "hpcnet-mpi", "hpcnet-shm", "torch-gloo", "hpcnet-gloo", "backward+mpi4py",
            "hpcnet-reducer-mpi", "hpcnet-reducer-shm"} <= names
    assert peers["hpcnet-reducer-mpi"] == peers["hpcnet-reducer-shm"] == "backward+mpi4py"
    assert [r["size_bytes"] for r in report["results"]] == [2**10, 2**12, 2**14, 2**16]
    for res in report["results"]:
        assert res["iters"] == 2 and set(res["methods"]) == names
        for name, entry in res["methods"].items():
            assert len(entry["time_s_rounds"]) == 2 and entry["busbw_GBps"]["median"] > 0
            assert ("ratio_vs_peer" in entry) == bool(peers[name])
    assert set(report["ratio_hpcnet_mpi_vs_mpi4py"]) == {str(s) for s in (2**10, 2**12, 2**14, 2**16)}
    assert report["target"]["size_bytes"] == 2**16  # the size nearest 25 MiB that ran
