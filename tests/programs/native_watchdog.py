"""Arm the native watchdog for 1 s, then ``disarm`` it, or (``hold``) block every thread holding the GIL."""
import sys
import threading
import time
from pathlib import Path

from hpcnet.fault.inject import block_holding_the_gil
from hpcnet.fault.native import NativeWatchdog

run_dir, disarm = Path(sys.argv[1]), sys.argv[2] == "disarm"
watchdog = NativeWatchdog(75)
watchdog.arm(time.monotonic() + 1.0, message="it's the native watchdog", failure_path=run_dir / "failure.json",
             report={"kind": "checkpoint", "why": "a 'quoted' $(reason) `here`"})
if disarm:
    watchdog.disarm()
    time.sleep(2.0)
    print("still alive", flush=True)
    sys.exit(0)
threading.Thread(target=block_holding_the_gil, name="stuck-writer", daemon=True).start()
block_holding_the_gil()  # the main thread too: no Python code runs any more in this process
