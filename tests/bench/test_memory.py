"""The memory benchmark: the contenders' table, the search for the largest model, the ladder of sizes, the
capacity ratios, and a quick functional run under mpirun (no timing assertions)."""

import json

import pytest


def test_memory_search_largest_brackets_the_answer():
    from hpcnet.bench.memory_capacity import search_largest

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

    from hpcnet.bench.memory_capacity import (
        CAP_SEQ,
        CAP_VOCAB,
        deeper_options,
        ladder_options,
        rung_parameters,
        start_rung,
        transformer_parameters,
    )
    from hpcnet.bench.memory_measure import paired_ratios, rotated
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


def test_memory_contenders_table():
    from hpcnet.bench.memory_contenders import CAP_CONTENDERS, CAP_TIMED, CONTENDERS, TIME_PEERS

    assert {"ddp", "fsdp2", "fsdp2+ac", "hpcnet-zero2", "hpcnet-zero2+ac", "hpcnet-zero3",
            "hpcnet-zero3+ac"} <= set(CAP_CONTENDERS)
    assert set(CAP_TIMED) <= set(CONTENDERS) and "fsdp2" in CAP_TIMED and set(TIME_PEERS) <= set(CONTENDERS)
    for name, spec in CONTENDERS.items():
        assert spec.kind in ("ddp", "ddp+torch-zero1", "fsdp2", "hpcnet") and spec.guess_bytes_per_param > 0
        assert spec.checkpointed == name.endswith("+ac") == bool(spec.plain)
        if spec.plain:  # the twin without checkpointing: the same trainer, searched before it
            plain = CONTENDERS[spec.plain]
            assert (plain.kind, plain.zero, plain.checkpointed) == (spec.kind, spec.zero, False)
            assert list(CONTENDERS).index(spec.plain) < list(CONTENDERS).index(name)


def test_memory_takes_any_optimizer_and_leaves_out_the_contenders_that_cannot_train_with_it(capsys):
    """--optim adafactor: FSDP2 is left out of the defaults with the reason (torch's Adafactor fails on its
    DTensor shards), and named, it is a one-line error; muon leaves out ZeroRedundancyOptimizer; --contenders
    chooses the table's, the references among them."""
    from hpcnet.bench.memory import _checked, _parser

    def parse(*argv):
        parser = _parser()
        return _checked(parser, parser.parse_args(list(argv)))

    args = parse("--optim", "adafactor")
    assert "fsdp2" not in args.contenders and "fsdp2" not in args.cap_contenders and "fsdp2" not in args.cap_time
    assert "hpcnet-zero3" in args.cap_contenders and "DTensor" in args.left_out["fsdp2"]
    assert "ddp+torch-zero1" in parse("--optim", "adafactor").contenders
    muon = parse("--optim", "muon")
    assert "ddp+torch-zero1" not in muon.contenders and "fsdp2" in muon.contenders
    table = parse("--optim", "muon", "--contenders", "ddp,hpcnet-zero0,hpcnet-zero2,hpcnet-zero3")
    assert table.contenders == ("ddp", "hpcnet-zero0", "hpcnet-zero2", "hpcnet-zero3")
    for argv, needle in ((["--optim", "adafactor", "--cap-contenders", "fsdp2"],
                          "--cap-contenders: fsdp2 cannot train with --optim adafactor: torch's Adafactor fails"),
                         (["--contenders", "hpcnet-zero2,ddp"], "--contenders: hpcnet-zero0 must be among them"),
                         (["--optim", "lbfgs"], "argument --optim: invalid choice: 'lbfgs'")):
        with pytest.raises(SystemExit) as err:
            parse(*argv)
        assert err.value.code == 2 and needle in capsys.readouterr().err


def test_memory_capacity_ratio_brackets_the_truth():
    from hpcnet.bench.memory_capacity import capacity_ratio

    found = {"a": {"parameters": 20, "next_parameters": 25}, "a+ac": {"parameters": 30, "next_parameters": 36},
             "b": {"parameters": 10, "next_parameters": 12}, "b+ac": {"parameters": 8, "next_parameters": 9},
             "none": {"parameters": 0, "next_parameters": 2}, "open": {"parameters": 40, "next_parameters": None}}
    r = capacity_ratio(found, ["a", "a+ac"], ["b", "b+ac"])
    assert (r["ratio"], r["numerator"], r["denominator"]) == (3.0, "a+ac", "b")
    # Each side's truth lies in [the largest that fit, the largest next size): 30..36 over 10..12.
    assert r["bracket"] == [30 / 12, 36 / 10]
    assert capacity_ratio(found, ["a"], ["b"])["bracket"] == [20 / 12, 25 / 10]
    assert capacity_ratio(found, ["open"], ["b"])["bracket"] is None  # nothing above 40 was tried
    assert capacity_ratio(found, ["a"], ["none"]) is None and capacity_ratio(found, ["a"], ["missing"]) is None


@pytest.mark.launch
def test_memory_under_mpirun(launch, tmp_path):
    from hpcnet.bench.memory_contenders import CONTENDERS, TIME_PEERS

    out = tmp_path / "memory.json"
    # Five of the capacity contenders (each kind, stage 3 with its twin; the others' search is the same code).
    searched = ["ddp", "fsdp2", "hpcnet-zero2", "hpcnet-zero3", "hpcnet-zero3+ac"]
    proc = launch(2, "memory", "--models", "mlp-small", "--steps", "1", "--rounds", "2", "--round-steps", "1",
                  "--cap-gb", "0.07", "--cap-contenders", ",".join(searched), "--cap-time", "fsdp2,hpcnet-zero3+ac",
                  "--json", str(out), module="hpcnet.bench", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in CONTENDERS:
        assert f"\n{name} " in proc.stdout
    assert "step ms" in proc.stdout and "largest transformer under a cap of 0.07 GB" in proc.stdout
    assert "hpcnet-zero2 / ddp" in proc.stdout and "load average" in proc.stdout
    assert "hpcnet-best / fsdp2-best" in proc.stdout and "on FSDP2's largest model" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "memory" and report["environment"]["world_size"] == 2
    (res,) = report["models"]
    assert set(res["memory"]) == set(res["timing"]) == set(CONTENDERS)
    for name in CONTENDERS:
        assert len(res["memory"][name]["peak_mib"]) == 2 and max(res["memory"][name]["peak_mib"]) > 0
        assert len(res["timing"][name]["step_s"]) == 2 and res["timing"][name]["step_s_summary"]["median"] > 0
    assert set(res["time_ratios"]) == set(TIME_PEERS)
    assert res["time_ratios"]["fsdp2"]["fsdp2"]["median"] == 1.0
    assert len(res["targets"]) == 5 and all(isinstance(t["met"], bool) for t in res["targets"])
    # Same weights, data and steps: the contenders train alike (FSDP2's weights gathered), and checkpointing
    # changes no bit (2 ranks: every sum of two gradients is the same, however bucketed).
    assert res["max_weight_difference"] < 1e-4 and set(res["differences"]) == set(CONTENDERS)
    assert res["max_checkpointing_difference"] == 0.0
    assert set(res["checkpointing_differences"]) == {n for n, s in CONTENDERS.items() if s.plain}
    cap = report["capacity"]
    assert cap["cap_bytes"] == 0.07e9 and list(cap["largest"]) == searched
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
        plain = CONTENDERS[name].plain
        if plain and cap["largest"][plain]["rung"]:  # the search starts above the twin's answer
            assert found["start_rung"] == cap["largest"][plain]["rung"] + 1
    assert {"hpcnet-best / fsdp2-best", "hpcnet-zero3 / fsdp2", "hpcnet-zero2 / ddp"} <= set(cap["ratios"])
    best = cap["ratios"]["hpcnet-best / fsdp2-best"]
    assert best["ratio"] == (max(cap["largest"][n]["parameters"] for n in searched if n.startswith("hpcnet"))
                             / cap["largest"]["fsdp2"]["parameters"])
    at = cap["fsdp2_model"]
    assert at["parameters"] == cap["largest"]["fsdp2"]["parameters"] and at["peer"] == "fsdp2"
    assert list(at["memory"]) == ["fsdp2", "hpcnet-zero3+ac"] and len(at["step_s_rounds"]["fsdp2"]) == 2
    assert at["time_ratios"]["fsdp2"]["median"] == 1.0 and at["time_ratios"]["hpcnet-zero3+ac"]["median"] > 0
