"""Checkpoints: sharded, incremental, checksummed HDF5 files, written in parallel and committed atomically.

``schema`` (the on-disk layout as pure logic), ``validate`` (checks of untrusted files), ``listing`` (a
directory's files), ``job`` (the records of one save), ``collective`` (the MPI-IO create), ``local`` and
``direct`` (the local writes), ``write`` (one save in collective and local stretches, the commit, pruning),
``read`` (the verified read and exchange at any world size), ``load`` (which checkpoint a resume takes),
``sharedfs`` (every rank sees one directory), ``manager`` (saves in the background and resumes), ``parts`` (the
model's and a torch optimizer's state, ``hpcnet.stateful``'s parts), ``state`` (a run's parts collected, the RNG),
``schedule`` (when it saves), ``damage`` (bytes flipped on purpose: ``fault.corrupt_checkpoint``), ``tool``
(``python -m hpcnet.ckpt``), ``export`` (a state dict, safetensors or a Hugging Face directory out of a
checkpoint).  Reference: docs/checkpoints.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "CheckpointManager": "manager", "TrainState": "state", "SavePolicy": "schedule", "scan": "listing",
    "open_read": "validate", "CheckpointInfo": "schema", "write_checkpoint": "write",
})
