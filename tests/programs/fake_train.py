"""Stands in for hpcnet.train (the test copies it to .../hpcnet/train.py): commits checkpoints, fails with 75."""
import os
import pathlib
import sys

options = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
ckpt = pathlib.Path(options["checkpoint.dir"])
ckpt.mkdir(parents=True, exist_ok=True)
attempt = int(os.environ["HPCNET_ATTEMPT"])
if attempt <= 2:  # the first two attempts each commit a checkpoint before failing; the third does not
    (ckpt / f"ckpt-{attempt * 10:010d}.h5").write_bytes(b"committed")
    (ckpt / f"ckpt-{attempt * 10 + 5:010d}.h5.tmp").write_bytes(b"in flight")
sys.exit(75)
