"""Checkpoints: ``format`` (on-disk layout, pure), ``validate`` (checks of untrusted files), ``listing`` (a
directory's files), ``collective`` and ``write`` (one save: the collective write, commit, prune), ``read`` (the
verified read and exchange), ``load`` (which checkpoint a load takes), ``shared`` (every rank sees one directory),
``manager`` (saves and resumes), ``state`` (what a run saves), ``policy`` (when it saves), ``tool`` (``python -m
hpcnet.ckpt``).  README: Checkpoints.
"""
