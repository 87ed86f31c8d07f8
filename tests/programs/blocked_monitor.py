"""A process whose "monitor" thread waits on a lock (a futex, like the GIL) while the main thread spins or sleeps;
or (``ticking``) whose monitor thread ticks every 50 ms, as a healthy one does, while the main thread sleeps.

blocked_monitor.py spin|sleep|ticking
"""
import sys
import threading
import time

from hpcnet.fault.liveness import name_this_thread

lock = threading.Lock()
lock.acquire()


def monitor():
    name_this_thread()
    if sys.argv[1] == "ticking":
        while True:
            sum(range(2000))
            time.sleep(0.05)
    lock.acquire()


threading.Thread(target=monitor, daemon=True).start()
print("ready", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    if sys.argv[1] in ("sleep", "ticking"):
        time.sleep(1)
