"""``python -m hpcnet`` is ``python -m hpcnet.train``."""

import runpy

runpy.run_module("hpcnet.train", run_name="__main__")
