"""Datasets: ``info`` (what describes one), ``h5`` (HDF5 files), ``arrays`` and ``convert`` (your arrays to
hpcnet's HDF5), ``cli`` (``python -m hpcnet.data``), ``user`` (``package.module:function`` datasets), ``sampler`` (which
samples each rank reads), ``balance`` (unequal shares for unequal ranks), ``loader`` (opening ``data.dataset``,
background reads) and ``synthetic`` (the built-in sets).  Reference: docs/data.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "DatasetInfo": "info", "BatchLoader": "loader", "open_dataset": "loader", "GlobalBatchSampler": "sampler",
    "eval_indices": "sampler", "Balancer": "balance",
})
