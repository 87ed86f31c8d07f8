"""The optimizer and the learning-rate schedule (``optim.*``): ``build`` makes the optimizer, ``schedule`` the
learning rate at each step."""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "build_optimizer": "build",
    "lr_factor": "schedule",
})
