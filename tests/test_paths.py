"""Run and checkpoint directory names, file names (pure)."""

import re

import pytest

from hpcnet.paths import (
    CKPT_NAME_RE,
    TMP_SUFFIX,
    attempt_dir,
    checkpoint_dir,
    checkpoint_name,
    metrics_file,
    rank_log,
    run_dir_path,
    stall_dump,
)


def test_checkpoint_dir_defaults_to_the_run_name_under_run_dir():
    assert str(checkpoint_dir("runs", "x", "")) == "runs/x.ckpt"
    assert str(checkpoint_dir("/a/b", "y", "")) == "/a/b/y.ckpt"
    assert str(checkpoint_dir("/a/b", "z", "/c/d")) == "/c/d"  # checkpoint.dir wins


def test_run_dir_is_timestamped_unless_exact(tmp_path):
    assert run_dir_path(tmp_path / "r", "x", exact=True) == tmp_path / "r"
    first = run_dir_path(tmp_path, "x", exact=False)
    assert first.parent == tmp_path and re.fullmatch(r"x-\d{8}-\d{6}", first.name)
    first.mkdir()
    second = run_dir_path(tmp_path, "x", exact=False)
    assert second.parent == tmp_path and not second.exists()  # a run started in the same second: a suffix
    assert attempt_dir(tmp_path, 2) == tmp_path / "attempt-2"


def test_checkpoint_names():
    assert checkpoint_name(7) == "ckpt-0000000007.h5"
    assert CKPT_NAME_RE.match(checkpoint_name(7)).group(1) == "0000000007"
    assert CKPT_NAME_RE.match(checkpoint_name(10**15)) and not CKPT_NAME_RE.match(checkpoint_name(7) + TMP_SUFFIX)
    assert not CKPT_NAME_RE.match("ckpt-12.h5")
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoint_name(-1)


def test_per_rank_file_names():
    assert (rank_log(3), metrics_file(3), stall_dump(3)) == ("rank3.log", "metrics.rank3.jsonl", "stall.rank3.txt")
