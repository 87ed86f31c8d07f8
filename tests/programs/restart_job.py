"""A job for the supervisor: notes its attempt in ./attempts, then ends as argv[1] says.

``exit:<status>``, ``sigkill``, or ``succeed-at:<k>`` (status 75 until attempt k, then 0).
"""
import os
import pathlib
import sys

attempt = os.environ.get("HPCNET_ATTEMPT", "?")
with pathlib.Path("attempts").open("a") as attempts:
    attempts.write(attempt + "\n")
how, _, value = sys.argv[1].partition(":")
if how == "sigkill":
    os.kill(os.getpid(), 9)
if how == "succeed-at":
    sys.exit(int(attempt) != int(value) and 75)
sys.exit(int(value))
