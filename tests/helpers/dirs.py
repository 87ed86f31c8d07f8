"""Directories every rank of a test shares, made or cleared by rank 0 (collective); and folders that a whole pytest
run shares, filled once."""


def made_dir(comm, path):
    """``path``, made by rank 0 (collective): where every rank of a test writes."""
    if comm.Get_rank() == 0:
        path.mkdir(parents=True)
    comm.Barrier()
    return path


def fresh_dir(comm, path):
    """``path``, removed by rank 0 if it exists (collective)."""
    import shutil

    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    comm.Barrier()
    return path


def made_once(tmp_path_factory, name, make):
    """The folder ``name`` that ``make(folder)`` fills once in a pytest run, whichever of xdist's workers asks first
    (the others wait for it): the output of one job that tests of several files start from (each job costs
    seconds of CPU a rank). Read it; copy it before changing it. Where ``make`` raises, the next caller tries again.
    """
    import fcntl
    import os
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common session folder
    folder, complete = root / f"once-{name}", root / f"once-{name}.complete"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not complete.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed try left
            folder.mkdir()
            make(folder)
            complete.touch()
    return folder
