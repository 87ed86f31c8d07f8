"""The memory benchmark: the search for the largest model, the ladder of sizes, and a quick functional run
under mpirun (no timing assertions)."""

import json

import pytest


def test_memory_search_largest_brackets_the_answer():
    from hpcnet.bench.memory import search_largest

    for limit in range(0, 9):
        for start in range(1, 9):
            calls = []

            def fits(k, calls=calls, limit=limit):
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
