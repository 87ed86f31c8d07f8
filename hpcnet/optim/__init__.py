"""The optimizer and the learning-rate schedule (``optim.*``): ``build`` makes the optimizer, ``schedule`` the
learning rate at each step."""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "build_optimizer": "build", "rebuild_optimizer": "build", "is_elementwise": "build", "describe": "build",
    "MuonWithAdamW": "muon",
    "lr_factor": "schedule",
    "Schedule": "schedule",
})
