"""Directories every rank of a test shares, made or cleared by rank 0 (collective)."""


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
