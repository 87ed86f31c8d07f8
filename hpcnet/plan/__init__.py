"""The memory planner (``dist.memory_cap_gb``, ``python -m hpcnet.plan``): each rank's peak memory and the step
time predicted for every ``dist.zero`` stage and activation checkpointing choice, without training.

``measure`` (one measured step of the plain model: what the planner knows of a model, ``ModelMemory``), ``peaks``
(the predictions from it, and the fastest choice that fits a cap), ``__main__`` (the command line).
Reference: docs/memory.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "ModelMemory": "measure", "StepMemory": "measure", "measure_model": "measure", "measure_config": "measure",
    "Prediction": "peaks", "predict": "peaks", "predictions": "peaks", "choose": "peaks", "cap_in_bytes": "peaks",
    "largest_share": "peaks", "configured_bucket_bytes": "peaks",
})
