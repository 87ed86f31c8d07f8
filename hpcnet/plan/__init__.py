"""The memory planner: each rank's peak predicted for each ``dist.zero`` stage and activation checkpointing choice,
from the model's parameters, the optimizer, the batch and one measured step (``hpcnet.plan.measure``)."""
