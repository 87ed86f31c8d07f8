"""Where each step's time goes: ``phases`` (each step's phases), ``timer`` (spans), ``stats`` (step-time
statistics across ranks), ``trace`` (a merged timeline of chosen steps), ``runlog`` (the run directory, logs and
metrics).  ``python -m hpcnet.report`` draws them.  Reference: docs/outputs.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "PhaseClock": "phases", "SpanTimer": "timer", "StepTracer": "trace", "MetricsWriter": "runlog",
    "make_run_dir": "runlog", "setup_logging": "runlog", "job_step_stats": "stats", "rank_step_stats": "stats",
})
