"""A process whose "monitor" thread waits on a lock (a futex, like the GIL) while the main thread spins or sleeps.

blocked_monitor.py spin|sleep
"""
import sys
import threading
import time

from hpcnet.fault.liveness import name_this_thread

lock = threading.Lock()
lock.acquire()


def monitor():
    name_this_thread()
    lock.acquire()


threading.Thread(target=monitor, daemon=True).start()
print("ready", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    if sys.argv[1] == "sleep":
        time.sleep(1)
