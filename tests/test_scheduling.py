"""The serial pass's scheduling units (tests/conftest.py): what must run on one pytest-xdist worker does."""

from tests.helpers.launch import ROOT


def test_the_serial_pass_keeps_a_shared_resource_and_a_reference_job_s_file_on_one_worker():
    """A module-scoped reference job runs once on every worker that takes a test of its file: the file's tests
    stay together (tests/conftest.py, ONE_WORKER), as the tests of one resource do; any other test goes alone."""
    from tests.conftest import ONE_WORKER, SHARED, worker_scope

    assert worker_scope("tests/test_cluster_faults.py::test_x") == worker_scope("tests/test_cluster.py::test_y")
    assert worker_scope("tests/test_slurm.py::test_x[a]") == "slurm"
    for path in ONE_WORKER:
        assert (ROOT / path).is_file(), path
        assert worker_scope(f"{path}::test_x") == worker_scope(f"{path}::test_y[1]") == path
    assert not any(path.startswith(tuple(SHARED.values())) for path in ONE_WORKER)
    assert worker_scope("tests/test_resume.py::test_x") == "tests/test_resume.py::test_x"
