"""Datasets: ``info`` (what describes one), ``h5`` (HDF5 files), ``user`` (``package.module:function``
datasets), ``sampler`` (which samples each rank reads), ``loader`` (opening ``data.dataset``, background
reads) and ``synthetic`` (the built-in sets; ``python -m hpcnet.data generate ...``).
"""
