"""Checkpoints: the on-disk format, the collective parallel-HDF5 write and the verified read, the directory's
listing, the manager that saves and resumes, the save policy, and the ``python -m hpcnet.ckpt`` tool.
"""
