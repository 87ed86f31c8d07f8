"""Under mpirun: in attempt 1, rank 0 starts a daemon (a session of its own), rank 1 kills mpirun and both ranks
live on; attempt 2 says which old processes are alive, and the session it runs in."""
import os
import pathlib
import signal
import subprocess
import sys
import time

here, rank = pathlib.Path(sys.argv[1]), os.environ["OMPI_COMM_WORLD_RANK"]


def alive(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


if os.environ["HPCNET_ATTEMPT"] == "1":
    if rank == "0":
        daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        (here / "pid.daemon").write_text(str(daemon.pid))
    (here / f"pid.{rank}").write_text(str(os.getpid()))
    if rank == "1":
        while len(list(here.glob("pid.*"))) < 3:
            time.sleep(0.05)
        os.kill(os.getppid(), signal.SIGKILL)  # mpirun dies (OOM killer); its ranks live on, orphaned
    time.sleep(120)
else:
    old = [int(p.read_text()) for p in here.glob("pid.*")]
    (here / f"sid.{rank}").write_text(str(os.getsid(0)))
    (here / f"alive.{rank}").write_text(" ".join(str(pid) for pid in old if alive(pid)))
