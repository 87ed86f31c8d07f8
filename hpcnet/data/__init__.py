"""Datasets: the HDF5 reader, user datasets, the synthetic generators, the global-batch sampler and the
background loader; ``python -m hpcnet.data`` makes the synthetic datasets.
"""
