"""The memory watch: steady growth in synthetic series, and sampling every n steps."""

import pytest

from hpcnet.fault.memwatch import MemoryWatch, Series, steady_growth, theil_sen_slope

STEPS = list(range(50, 550, 50))


@pytest.mark.parametrize("series, leak", [
    ([1000 + 40 * i for i in range(10)], True),  # a steady leak: 360 MiB over the window
    ([1000 + 40 * i + (25 if i % 2 else -25) for i in range(10)], True),  # with noise
    ([1000, 1000, 1120, 1120, 1120, 1240, 1240, 1240, 1360, 1360], True),  # in allocator-sized steps
    ([1000] * 5 + [1500] * 5, False),  # one jump: a cache filled once
    ([1000] * 4 + [1900] + [1000] * 5, False),  # a spike that comes back
    ([1000 + (i % 3) * 200 for i in range(10)], False),  # noisy but flat
    ([1000 + 20 * i for i in range(10)], False),  # grows, but less than the threshold
    ([1000] * 9 + [1600], False),  # a jump at the very end
])
def test_steady_growth(series, leak):
    assert (steady_growth(STEPS, series, 256.0) is not None) == leak


def test_theil_sen_ignores_outliers():
    ys = [10.0 * x for x in range(10)]
    ys[4] = 1e6
    assert theil_sen_slope(list(range(10)), ys) == pytest.approx(10.0)


def test_series_warns_once_per_window_and_reports_the_trend():
    series = Series("rss", window=5)
    warnings = [series.add(step, 100.0 + step, threshold_mb=200) for step in range(0, 2000, 100)]
    hits = [i for i, w in enumerate(warnings) if w is not None]
    assert hits[0] == 4 and all(b - a >= 5 for a, b in zip(hits, hits[1:]))  # a whole new window each time
    trend = series.trend()
    assert trend["first_mb"] == 100.0 and trend["last_mb"] == 2000.0 and trend["peak_mb"] == 2000.0
    assert trend["slope_mb_per_1000_steps"] == pytest.approx(1000.0) and trend["samples"] == 20


def test_memory_watch_samples_every_n_steps(monkeypatch, tmp_path, caplog):
    values = iter([500.0 + 50 * i for i in range(100)])
    monkeypatch.setattr("hpcnet.fault.memwatch.rss_mb", lambda: next(values))
    watch = MemoryWatch(every_steps=10, window=4, growth_mb=100.0, run_dir=tmp_path, rank=3)
    for step in range(1, 101):
        watch.maybe_sample(step)
    summary = watch.summary()
    assert summary["trend"]["rss"]["samples"] == 10 and summary["trend"]["rss"]["last_mb"] == 950.0
    assert summary["warnings"] and summary["warnings"][0]["rank"] == 3 and summary["warnings"][0]["step"] == 40
    assert "rank 3: rss memory grew steadily by 150 MiB" in caplog.text
    assert "gpu_allocated" not in summary["trend"]  # CPU device: resident memory only
