"""Stands in for a launcher running hpcnet.train on two hosts (the test copies it to .../hpcnet/train.py); attempt 1
fails as ``FAKE_MODE`` says, attempt 2 succeeds.

``hang``: the job declares its failure (failure.json: ranks 2 and 3 on hostB silent, as the monitor on hostA writes
it after a partition) and the launcher then hangs for good, ignoring SIGTERM, with a child process of its own (a
daemon it started); ``lost``: the ranks report ready on hostA and hostB, then the launcher prints Open MPI's message
of a lost daemon (naming hostB) and exits with 9, as mpirun does when every process of hostB is killed;
``started``: the same with mpirun's message of daemons it could not start (which names no host); ``unstarted``: that
message and status before any rank started (a launch that failed); ``halfstart``: ranks 0 and 1 report ready on
hostA, ranks 2 and 3 never do, and the launcher waits for good, ignoring SIGTERM (mpirun waiting for a daemon that
died as it started); ``prte0``: the ranks report ready on hostA and hostB, then the launcher prints Open MPI 5's message
of a daemon that did not report (naming hostB) and exits with 0, as prterun does when every process of hostB is
killed.  Each attempt notes its pid, the fence it saw and, for ``hang``, its child's pid in the working directory;
attempt 2 finishes, writing summary.json as hpcnet.train does.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

options = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
run_dir = pathlib.Path(options["run.dir"])
run_dir.mkdir(parents=True, exist_ok=True)
notes = pathlib.Path.cwd()
attempt = int(os.environ["HPCNET_ATTEMPT"])
fence = pathlib.Path(options["checkpoint.dir"]) / "fence"
seen = json.loads(fence.read_text())
with (notes / "attempts.jsonl").open("a") as out:
    out.write(json.dumps({"attempt": attempt, "pid": os.getpid(), "fence": [seen["launch"], seen["attempt"]],
                          "launch_id": os.environ["HPCNET_LAUNCH_ID"]}) + "\n")
if attempt > 1:
    (run_dir / "summary.json").write_text(json.dumps({"steps": 0, "start_step": 0}))
    sys.exit(0)
mode = os.environ["FAKE_MODE"]
if mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(600)"])
    (notes / "child.pid").write_text(str(child.pid))
    report = {"kind": "heartbeat", "failed": [{"rank": 2, "host": "hostB", "silent_s": 6.0},
                                              {"rank": 3, "host": "hostB", "silent_s": 6.0}],
              "message": "rank 2 on hostB missed 3 heartbeats", "exit_code": 75, "detected_by": 0,
              "detected_host": "hostA", "detected_wall": time.time()}
    (run_dir / "failure.json").write_text(json.dumps(report))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    sys.exit(3)
if mode == "halfstart":
    ready = pathlib.Path(os.environ["HPCNET_READY"])
    ready.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        (ready / f"ready.{rank}").write_text(f"4 {1000 + rank} {time.time():.3f} hostA\n")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    sys.exit(3)
if mode in ("lost", "started", "prte0"):
    ready = pathlib.Path(os.environ["HPCNET_READY"])
    ready.mkdir(parents=True, exist_ok=True)
    for rank, host in enumerate(("hostA", "hostA", "hostB", "hostB")):
        (ready / f"ready.{rank}").write_text(f"4 {1000 + rank} {time.time():.3f} {host}\n")
if mode == "lost":
    print("""--------------------------------------------------------------------------
ORTE has lost communication with a remote daemon.

  HNP daemon   : [[41235,0],0] on node hostA
  Remote daemon: [[41235,0],1] on node hostB

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------""", file=sys.stderr, flush=True)
elif mode == "prte0":
    print("""------------------------------------------------------------
A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the
daemon executable, or the executable was unable to find its
required supporting libraries. In some cases, the daemon was
able to execute, but was unable to complete a TCP connection
back to prterun:

  Local host:    hostA
  Remote host:   hostB
  Daemon exit status: 0
------------------------------------------------------------""", file=sys.stderr, flush=True)
    sys.exit(0)
else:
    print("""--------------------------------------------------------------------------
ORTE was unable to reliably start one or more daemons.
This usually is caused by:

* not finding the required libraries and/or binaries on
  one or more nodes. Please check your PATH and LD_LIBRARY_PATH
  settings, or configure OMPI with --enable-orterun-prefix-by-default
--------------------------------------------------------------------------""", file=sys.stderr, flush=True)
sys.exit(9)
