"""Tests of hpcnet.agree: ``agree_on_first_error`` at every size in one process (a rank per thread), then under
MPI; ``ranks_differing`` under MPI."""

import threading

import pytest

from hpcnet.agree import PeerError, agree_on_error, agree_on_first_error, is_agreed, ranks_differing
from hpcnet.errors import ConfigError, DatasetError, ExitCode, exit_code_of


class ThreadComm:
    """One rank of a communicator whose ranks are threads of this process: just ``allgather``."""

    def __init__(self, rank, slots, barrier):
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def allgather(self, value):
        self.slots[self.rank] = value
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return gathered


def on_ranks(agree, errors):
    """Run ``agree(comm, errors[rank])`` on one thread per rank; what each rank raised (None: returned)."""
    size = len(errors)
    slots, barrier, raised = [None] * size, threading.Barrier(size, timeout=30), [None] * size

    def rank_main(rank):
        try:
            agree(ThreadComm(rank, slots, barrier), errors[rank])
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            raised[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return raised


class LocalDatasetError(DatasetError):
    """A user's own subclass of an hpcnet error."""


@pytest.mark.parametrize("size", [1, 2, 4])
def test_no_error_returns_everywhere(size):
    assert on_ranks(agree_on_first_error, [None] * size) == [None] * size


def test_a_failure_on_some_ranks_names_them_on_every_rank():
    own = DatasetError("bad file")
    raised = on_ranks(agree_on_first_error, [None, None, own, None])
    assert all(type(exc) is DatasetError and str(exc) == "bad file (on ranks [2] of 4 only)" for exc in raised)
    assert all(is_agreed(exc) for exc in raised)
    assert raised[2] is not own and raised[2].__cause__ is own  # the message changed: a new error, chained
    assert raised[0].__cause__ is None


def test_a_failure_on_every_rank_raises_the_first_message():
    errors = [ConfigError("first"), ConfigError("second"), ConfigError("first")]
    raised = on_ranks(agree_on_first_error, errors)
    assert [str(exc) for exc in raised] == ["first"] * 3 and all(type(exc) is ConfigError for exc in raised)
    assert raised[0] is errors[0] and raised[2] is errors[2]  # exactly that error: raised as itself
    assert raised[1] is not errors[1] and raised[1].__cause__ is errors[1]


def test_a_subclass_is_raised_as_its_hpcnet_error():
    own = LocalDatasetError("no rows")
    raised = on_ranks(agree_on_first_error, [own, own])
    assert all(type(exc) is DatasetError and str(exc) == "no rows" for exc in raised)
    assert raised[0].__cause__ is own


def test_other_errors_are_echoed_as_agree_on_error_echoes_them():
    own = RuntimeError("boom")
    raised = on_ranks(agree_on_first_error, [None, own])
    assert isinstance(raised[0], PeerError) and raised[0].rank == 1
    assert str(raised[0]) == "rank 1: RuntimeError: boom (on ranks [1] of 2 only)"
    assert exit_code_of(raised[0]) == exit_code_of(own) == ExitCode.CODE_ERROR
    assert isinstance(raised[1], PeerError) and raised[1].__cause__ is own


def test_agree_on_error_differs_where_the_failed_rank_keeps_its_own():
    own = DatasetError("bad file")
    raised = on_ranks(agree_on_error, [None, own])
    assert raised[1] is own and str(raised[0]) == "bad file"  # no rank list; each failed rank raises its own


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_one_error_under_mpi(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    with pytest.raises(DatasetError) as error:
        agree_on_first_error(comm, DatasetError("only the last rank fails") if rank == size - 1 else None)
    message = str(error.value)
    assert comm.allgather(message) == [message] * size
    assert message.startswith("only the last rank fails")
    assert message.endswith(f" (on ranks [{size - 1}] of {size} only)") == (size > 1)
    agree_on_first_error(comm, None)  # nothing pending: returns on every rank



@pytest.mark.mpi
def test_ranks_differing_names_the_same_ranks_on_every_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    assert ranks_differing(comm, ("same", 1)) == []
    odd = ranks_differing(comm, "x" if rank % 2 == 0 else "y")
    assert odd == list(range(1, size, 2))
    assert comm.allgather(odd) == [odd] * size
    assert ranks_differing(comm, rank) == list(range(1, size))  # measured against rank 0's value
