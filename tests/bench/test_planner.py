"""The planner benchmark: a quick functional run under mpirun (no accuracy assertions: the record has those)."""

import json

import pytest


@pytest.mark.launch
def test_planner_under_mpirun(launch, tmp_path):
    out = tmp_path / "planner.json"
    proc = launch(2, "planner", "--rungs", "1", "--steps", "2", "--json", str(out), module="hpcnet.bench",
                  timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "within 10%" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert {(r["stage"], r["activation_checkpointing"]) for r in results} == \
        {(0, "off"), (1, "off"), (2, "off"), (3, "off"), (0, "blocks"), (2, "blocks"), (3, "blocks")}
    assert all(r["predicted_bytes"] > 0 and r["measured_bytes"] > 0 for r in results)
