"""train.trace_steps: one Chrome trace of the chosen steps, a process row per rank, clocks aligned over MPI."""

import json

import pytest

from hpcnet.config.load import load_config
from hpcnet.errors import ConfigError
from hpcnet.observe.trace import clock_offsets, parse_steps
from hpcnet.paths import TRACE_FILE
from tests.helpers.data import tiny_images
from tests.helpers.train import train_config


def test_steps_spec():
    assert parse_steps("") is None and parse_steps("3:3") == (3, 3) and parse_steps("2:10") == (2, 10)
    for bad in ("3", "5:2", "0:4", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="START:END"):
            parse_steps(bad)
    with pytest.raises(ConfigError, match="train.trace_steps"):
        load_config(overrides=["train.trace_steps=9:1"])
    with pytest.raises(ConfigError, match="train.trace_ops needs train.trace_steps"):
        load_config(overrides=["train.trace_ops=true", 'train.trace_steps=""'])
    assert load_config().train.trace_steps == "11:12"  # the default job leaves a trace for the report


@pytest.mark.mpi
def test_clock_offsets_on_one_node_are_small(comm):
    offset, error = clock_offsets(comm)
    if comm.Get_rank() == 0:
        assert offset == 0 and error == 0
    else:
        assert error > 0 and abs(offset) <= error + 1e-3  # one clock (CLOCK_MONOTONIC) on one node


@pytest.mark.mpi
@pytest.mark.parametrize("ops", [False, True])
def test_the_trace_has_a_row_per_rank_with_steps_phases_and_collectives(comm, data_plane, mpi_tmp_path, ops):
    from hpcnet.train import run

    size = comm.Get_size()
    dataset = tiny_images(comm, mpi_tmp_path, "trace.h5", num_train=256, num_eval=32, seed=2)
    name = f"trace-{ops}"
    run(train_config(mpi_tmp_path, dataset, name, "model.name=mlp", "train.steps=6", "train.trace_steps=2:3",
                     f"train.trace_ops={str(ops).lower()}", "checkpoint.every_steps=3"), comm, plane=data_plane)
    if comm.Get_rank() == 0:
        trace = json.loads((mpi_tmp_path / "runs" / name / TRACE_FILE).read_text())
        events = trace["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        assert sorted(names) == list(range(size)) and all(f"rank {r}" in names[r] for r in range(size))
        assert len(trace["otherData"]["clock_error_us"]) == size and trace["otherData"]["steps"] == "2:3"
        for rank in range(size):
            mine = [e for e in events if e["pid"] == rank and e["ph"] != "M"]
            steps = sorted((e for e in mine if e.get("cat") == "step"), key=lambda e: e["ts"])
            assert [e["name"] for e in steps] == ["step 2", "step 3"]
            begin, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
            phases = [e for e in mine if e.get("cat") == "phase"]
            assert {"forward", "backward", "comm", "optimizer", "data"} <= {e["name"] for e in phases}
            assert all(begin - 1 <= e["ts"] and e["ts"] + e["dur"] <= end + 1 for e in phases)
            collectives = [e for e in mine if e.get("cat") == "collective"]
            assert any(e["name"] == "step_boundary" for e in collectives)
            if size > 1:
                assert any(e["name"].startswith("allreduce.bucket") and e["args"]["bytes"] > 0 for e in collectives)
            assert any(e["name"].startswith("checkpoint step 3") for e in mine)
            assert any(e.get("cat") == "op" for e in mine) == ops
    comm.Barrier()
