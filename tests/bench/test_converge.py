"""The convergence benchmark: a short run of two compression paths across virtual nodes, the refusal of one node,
its options and its pure logic."""

import json
import math
from pathlib import Path

import pytest

from hpcnet.bench import converge


@pytest.mark.launch
def test_none_and_int8_across_two_virtual_nodes(launch, tmp_path):
    out = tmp_path / "converge.json"
    # 2 virtual nodes of one rank each: int8 compresses between them as between nodes of any size.
    proc = launch(2, "converge", "--steps", "20", "--paths", "int8,none", "--eval-every", "10",
                  "--set", "train.batch_size=8", "--set", "model.options.width=4", "--set", "dist.probe=false",
                  "--json", str(out), module="hpcnet.bench", timeout=150, env={"HPCNET_RANKS_PER_NODE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    (res,) = report["results"]
    assert res["job"] == "default" and res["steps"] == 20
    runs = {r["path"]: r for r in res["runs"]}
    assert list(runs) == ["none", "int8"]  # the baseline first, whatever the order asked
    assert runs["int8"]["transport"] == "hierarchical-mpi+gloo"  # compressed between the 2 virtual nodes
    assert runs["int8"]["compression"] == "int8" and runs["none"]["compression"] == "none"
    for r in runs.values():
        assert r["exit_code"] == 0 and r["steps"] == 20
        assert math.isfinite(r["eval_loss"]) and r["steps_per_s"] > 0
        assert [step for step, _ in r["eval_curve"]] == [10, 20]
    assert runs["none"]["ratio_pct"] == 0 and math.isfinite(runs["int8"]["ratio_pct"])
    assert isinstance(runs["int8"]["within_target"], bool)
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert any(row[:1] == ["none"] and row[-1] == runs["none"]["transport"] for row in rows)
    assert any(row[:1] == ["int8"] and row[-1] == "hierarchical-mpi+gloo" for row in rows)
    assert not report["kept"] and not Path(report["work_dir"]).exists()  # its temporary directory is gone


def test_one_node_is_refused_with_status_2(monkeypatch, capsys):
    """Nothing is compressed within a node: on one node the benchmark says how to get several (at any size)."""
    from mpi4py import MPI

    from tests.helpers.comm import hostnames

    if len(set(hostnames(MPI.COMM_WORLD))) > 1:
        pytest.skip("the ranks are on several hosts: that is several nodes")
    monkeypatch.delenv("HPCNET_RANKS_PER_NODE", raising=False)
    assert converge.main(["--steps", "2"]) == 2
    if MPI.COMM_WORLD.Get_rank() == 0:
        err = capsys.readouterr().err
        assert "one node" in err and "HPCNET_RANKS_PER_NODE" in err and "several hosts" in err


@pytest.mark.parametrize("argv, message", [
    (["--paths", "bf16,int8"], "--paths must include none"),
    (["--paths", "none,int4"], "--paths: unknown int4"),
    (["--jobs", "resnet"], "--jobs: unknown resnet"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--set", "dist.compression=int3"], "dist.compression"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        converge._parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_options_default_to_ten_evaluations_and_the_baseline_first():
    args = converge._parse_args(["--steps", "1000", "--paths", "int8,bf16,none,int8"])
    assert args.eval_every == 100 and args.path_list == ["none", "int8", "bf16"]
    assert converge._parse_args(["--steps", "5"]).eval_every == 1


def test_each_run_has_its_own_directories_and_set_wins(tmp_path):
    from hpcnet.config.load import load_config

    def cfg(path, *extra):
        return load_config(overrides=converge.run_overrides(
            "transformer", path, dataset=tmp_path / "tokens.h5", work_dir=tmp_path, steps=50, eval_every=10,
            seed=3, extra=list(extra)))

    none, bf16 = cfg("none"), cfg("bf16", "dist.inter_node=primary")
    assert none.run.dir != bf16.run.dir and none.checkpoint.dir != bf16.checkpoint.dir
    assert none.data.dataset == bf16.data.dataset == str(tmp_path / "tokens.h5")
    assert (none.model.name, none.train.steps, none.train.eval_every, none.run.seed) == ("transformer", 50, 10, 3)
    assert (none.dist.compression, bf16.dist.compression) == ("none", "bf16")
    assert bf16.dist.inter_node == "primary"  # --set comes last
    assert not none.checkpoint.at_end and none.checkpoint.every_s == 0 and none.train.trace_steps == ""


def test_losses_are_compared_with_the_fp32_run():
    def run(path, loss, curve):
        return {"path": path, "eval_loss": loss, "eval_curve": curve}

    runs = [run("none", 2.0, [(10, 4.0), (20, 2.0)]), run("bf16", 2.01, [(10, 4.4), (20, 2.01)]),
            run("int8", 2.1, [(20, 2.1)]), run("fp16", float("nan"), [])]
    converge.compare(runs, target_pct=1.0)
    assert runs[0]["ratio_pct"] == 0 and runs[0]["within_target"] is None
    assert runs[1]["ratio_pct"] == pytest.approx(0.5) and runs[1]["within_target"] is True
    assert runs[1]["curve_ratio_pct"] == [[10, pytest.approx(10.0)], [20, pytest.approx(0.5)]]
    assert runs[2]["ratio_pct"] == pytest.approx(5.0) and runs[2]["within_target"] is False
    assert runs[3]["ratio_pct"] is None and runs[3]["within_target"] is None
    assert [converge.verdict(x, 1.0) for x in (0.99, 1.01, -0.5, -1.5, None)] == ["yes", "no", "yes", "yes, lower",
                                                                                    "?"]


def test_the_eval_curve_is_read_from_the_metrics(tmp_path):
    metrics = tmp_path / "metrics.rank0.jsonl"
    metrics.write_text('{"step": 10, "loss": 2.5}\n{"step": 10, "eval_loss": 2.25, "eval_accuracy": 0.5}\n'
                       'not json\n{"step": 20, "eval_loss": 2.0}\n')
    assert converge.eval_curve(metrics) == [(10, 2.25), (20, 2.0)]
    assert converge.eval_curve(tmp_path / "missing.jsonl") == []
