"""A replacement's entry point, ``python -m hpcnet.fault.replacement``: what the survivors of a shrunk job start
for each lost rank (``hpcnet.fault.grow``), and the tags of the messages between them.

MPI starts first, before torch and the trainer are imported: the survivors' ``MPI_Comm_spawn`` returns as soon as
every replacement's MPI has, and the replacements import the rest while the survivors go on training.  Its first
message (``HELLO_TAG``) goes to the survivors' rank 0 at once, while rank 0 is certainly there: Open MPI 5 sets up
a connection at the first message, and setting one up to a process that has since ended waits for good.  Then it
is ``python -m hpcnet.train``, which finds its parent, says it is ready (``READY_TAG``) and waits for the word
(``WORD_TAG``).
"""

HELLO_TAG, READY_TAG, WORD_TAG = 4600, 4601, 4602
"""Messages from a replacement to the survivors' rank 0 (connected, ready) and back (join or leave)."""

if __name__ == "__main__":
    import runpy

    from mpi4py import MPI  # MPI_Init: the spawn that started this process completes

    # Not waited for: where rank 0 ended before the connection was made, a blocking send would wait for good, and
    # the next survivor's word to leave (``hpcnet.fault.grow.join_if_spawned``) would never be read.  Kept alive
    # here, as a global of this module, for as long as the process runs.
    HELLO = MPI.Comm.Get_parent().isend(None, dest=0, tag=HELLO_TAG)
    runpy.run_module("hpcnet.train", run_name="__main__", alter_sys=True)
