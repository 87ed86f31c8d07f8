"""``python -m hpcnet.bench``: the benchmarks it lists and the names it rejects."""

from hpcnet.bench.__main__ import benchmarks
from hpcnet.bench.__main__ import main as bench_main


def test_entry_point_lists_and_rejects(capsys):
    assert {"allreduce", "train"} <= set(benchmarks())
    assert "common" not in benchmarks()
    assert "stepsplit" not in benchmarks()  # bench train's instrumented block, no entry point of its own
    assert "memory_capacity" not in benchmarks()  # a part of bench memory: a benchmark is a module with a main
    assert bench_main(["--help"]) == 0
    assert "allreduce" in capsys.readouterr().out
    assert bench_main(["no_such_bench"]) == 2
    assert "no benchmark named 'no_such_bench'" in capsys.readouterr().err
