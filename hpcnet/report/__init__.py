"""``python -m hpcnet.report RUN_DIR``: plots and a report.md of a run, running, finished or crashed, or of a launch.

``read`` parses the directory (stdlib only), ``figures`` draws the PNGs with
matplotlib's Agg canvas, ``markdown`` writes report.md, ``build`` ties them
together.  Neither torch nor mpi4py is imported: the report runs anywhere the
run directory can be read, in about a second.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "build_report": "build",
})
