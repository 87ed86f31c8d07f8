"""Benchmarks: the helpers' arithmetic, and quick functional runs under mpirun (no timing assertions)."""

import json
import re

import pytest

from hpcnet.bench.__main__ import benchmarks
from hpcnet.bench.__main__ import main as bench_main
from hpcnet.bench.common import algbw, busbw, format_size, parse_size, size_sweep, summarize, table


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("1KiB", 1024), ("64KiB", 65536), ("64k", 65536), ("25MiB", 25 * 2**20), ("25 MiB", 25 * 2**20),
    ("1.5GiB", 3 * 2**29), ("1KB", 1000), ("2MB", 2_000_000), ("256mib", 256 * 2**20),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 apples", "0", "0.3B", "-4KiB", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size_round_trips():
    for nbytes in (1, 1000, 1024, 65536, 25 * 2**20, 3 * 2**29):
        assert parse_size(format_size(nbytes)) == nbytes
    assert format_size(25 * 2**20) == "25MiB"


def test_size_sweep():
    sizes = size_sweep(2**10, 2**28, 4, extra=(25 * 2**20, 2**30))
    assert sizes[0] == 2**10 and sizes[-1] == 2**28 and 25 * 2**20 in sizes
    assert 2**30 not in sizes and len(sizes) == 11 and sizes == sorted(set(sizes))
    assert size_sweep(1000, 1000, 2) == [1000]
    with pytest.raises(ValueError):
        size_sweep(10, 1, 2)
    with pytest.raises(ValueError):
        size_sweep(1, 10, 1)


def test_bandwidth_formulas_follow_nccl_tests():
    assert algbw(2 * 10**9, 2.0) == 10**9
    assert busbw(10**9, 1.0, 2) == pytest.approx(1e9)  # 2(n-1)/n = 1 for two ranks
    assert busbw(10**9, 1.0, 4) == pytest.approx(1.5e9)
    assert busbw(10**9, 1.0, 8) == pytest.approx(1.75e9)
    assert busbw(10**9, 1.0, 1) == 0.0  # one rank moves nothing


def test_summarize_and_table():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "spread": pytest.approx(3.6)}
    with pytest.raises(ValueError):
        summarize([])
    text = table(["size", "GB/s"], [["1KiB", "0.1"], ["256MiB", "12.25"]])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].startswith("------") and lines[3].endswith("12.25")


def test_entry_point_lists_and_rejects(capsys):
    assert {"allreduce", "train"} <= set(benchmarks())
    assert "common" not in benchmarks()
    assert "stepsplit" not in benchmarks()  # bench train's instrumented block, no entry point of its own
    assert bench_main(["--help"]) == 0
    assert "allreduce" in capsys.readouterr().out
    assert bench_main(["no_such_bench"]) == 2
    assert "no benchmark named 'no_such_bench'" in capsys.readouterr().err


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


def test_memory_search_largest_brackets_the_answer():
    from hpcnet.bench.memory import search_largest

    for limit in range(0, 9):
        for start in range(1, 9):
            calls = []

            def fits(k):
                calls.append(k)
                return k <= limit

            best, seen = search_largest(fits, start, 8)
            assert best == limit and seen == {k: k <= limit for k in calls} and len(calls) == len(set(calls))
            if best:
                assert seen[best] and (best == 8 or seen[best + 1] is False)  # both sides measured
            else:
                assert seen[1] is False
    with pytest.raises(ValueError, match="start rung"):
        search_largest(lambda k: True, 0, 8)


def test_memory_ladder_and_helpers():
    import torch

    from hpcnet.bench.memory import (
        CAP_SEQ,
        CAP_VOCAB,
        deeper_options,
        ladder_options,
        paired_ratios,
        rotated,
        rung_parameters,
        start_rung,
        transformer_parameters,
    )
    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    for rung in (1, 2, 5):
        with torch.device("meta"):
            model = build_model("transformer", DatasetInfo("tokens", (CAP_SEQ,), CAP_VOCAB), ladder_options(rung))
        assert sum(p.numel() for p in model.parameters()) == rung_parameters(rung)
    assert rung_parameters(8) == 29_447_168  # the table's transformer
    assert [rung_parameters(k) < rung_parameters(k + 1) for k in range(1, 20)] == [True] * 19
    assert start_rung(30e6 * 20, 20) == 8 and start_rung(1, 20) == 1
    deeper = deeper_options(7)  # width 448: 7 + 1, 2, 3 blocks stay below rung 8's parameters
    assert [d["n_layers"] for d in deeper] == [8, 9, 10] and {d["d_model"] for d in deeper} == {448}
    assert all(rung_parameters(7) < transformer_parameters(d["d_model"], d["n_layers"]) < rung_parameters(8)
               for d in deeper)
    with pytest.raises(ValueError):
        ladder_options(0)
    assert rotated(("a", "b", "c"), 0) == ["a", "b", "c"] and rotated(("a", "b", "c"), 4) == ["b", "c", "a"]
    r = paired_ratios([2.0, 3.0, 9.0], [1.0, 3.0, 3.0])
    assert r["median"] == 2.0 and r["min"] == 1.0 and r["max"] == 3.0
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


@pytest.mark.launch
def test_memory_under_mpirun(launch, tmp_path):
    from hpcnet.bench.memory import CAP_CONTENDERS, CONTENDERS, TIME_PEERS

    out = tmp_path / "memory.json"
    proc = launch(2, "memory", "--models", "mlp-small", "--steps", "1", "--rounds", "2", "--round-steps", "1",
                  "--cap-gb", "0.07", "--json", str(out), module="hpcnet.bench", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in CONTENDERS:
        assert f"\n{name} " in proc.stdout
    assert "step ms" in proc.stdout and "largest transformer under a cap of 0.07 GB" in proc.stdout
    assert "hpcnet-zero2 / ddp" in proc.stdout and "load average" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "memory" and report["environment"]["world_size"] == 2
    (res,) = report["models"]
    assert set(res["memory"]) == set(res["timing"]) == set(CONTENDERS)
    for name in CONTENDERS:
        assert len(res["memory"][name]["peak_mib"]) == 2 and max(res["memory"][name]["peak_mib"]) > 0
        assert len(res["timing"][name]["step_s"]) == 2 and res["timing"][name]["step_s_summary"]["median"] > 0
    assert set(res["time_ratios"]) == set(TIME_PEERS)
    assert res["time_ratios"]["fsdp2"]["fsdp2"]["median"] == 1.0
    assert len(res["targets"]) == 4 and all(isinstance(t["met"], bool) for t in res["targets"])
    # Same weights, data and steps: the contenders train alike (FSDP2's weights gathered).
    assert res["max_weight_difference"] < 1e-4 and set(res["differences"]) == set(CONTENDERS)
    cap = report["capacity"]
    assert cap["cap_bytes"] == 0.07e9 and set(cap["largest"]) == set(CAP_CONTENDERS)
    for name, found in cap["largest"].items():
        mine = [t for t in cap["trials"] if t["contender"] == name]
        tried = {t["rung"]: t for t in mine if not t["extra_blocks"]}
        assert found["rung"] == max((k for k, t in tried.items() if t["fits"]), default=0)
        assert all(t["fits"] == (t["peak_bytes"] <= cap["cap_bytes"]) for t in mine)
        assert found["rung"] + 1 in tried  # the rung above was measured not to fit
        # The refinement: the largest size that fit, and a larger one tried that did not.
        assert found["parameters"] == max((t["parameters"] for t in mine if t["fits"]), default=0)
        assert found["next_parameters"] == min(t["parameters"] for t in mine
                                               if not t["fits"] and t["parameters"] > found["parameters"])


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
