"""Sharding across ranks (``dist.zero``): what each rank owns, and everything that differs by stage.

``layout`` (the units of ownership: a parameter, or rows of a large one), ``assign`` (who owns what: the speed
probe and the cost model), ``owners`` (the owners in force: owners.json, checkpoints, reassignment), ``placement``
(where a bucket's sums go: ``ReplicatedGradients`` at stages 0 and 1, ``ShardedGradients`` at 2 and 3),
``optimizer`` (the sharded optimizer state, stages 1 to 3, and the gradient norm unit by unit), ``params``
(stage 3's sharded parameters) and ``rounds`` (their gathers as rounds of every rank).  Reference:
docs/memory.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "Unit": "layout", "ShardLayout": "layout", "split_units": "layout",
    "measure_speed": "assign", "assign_owners": "assign",
    "Owners": "owners",
    "Placement": "placement", "ReplicatedGradients": "placement", "ShardedGradients": "placement",
    "ShardedOptimizer": "optimizer", "ParamGather": "optimizer",
    "unit_grad_norm": "optimizer", "norm_order": "optimizer",
    "ShardedParams": "params", "ShardedParameter": "params",
    "Rounds": "rounds",
})
