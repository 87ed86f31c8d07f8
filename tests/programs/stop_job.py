"""A job that exits 76 on SIGTERM or SIGUSR2, after writing ./ready; 75 if no signal comes."""
import pathlib
import signal
import sys
import time

for s in (signal.SIGTERM, signal.SIGUSR2):
    signal.signal(s, lambda n, f: sys.exit(76))
pathlib.Path("ready").write_text("1")
time.sleep(50)
sys.exit(75)
