"""Bring up torch.distributed from MPI: no MASTER_ADDR, no hostfile, no guessing.

Rank 0 picks the rendezvous address deliberately (loopback when every rank
shares one node; otherwise the first of its interfaces, in ``netif``'s order
(IPoIB and RDMA first), that *every* rank can actually connect to, tested over
TCP against short-lived probe listeners),
then starts the TCPStore on a socket bound to that address alone, on a free
port the kernel gives it, so there is no race for a port and nothing listens
on the other interfaces.  The address and port travel to the other ranks
over MPI.  ``MASTER_ADDR``/``MASTER_PORT`` win when the user sets them.

The store has no authentication: whoever reaches its address and port can
read and write its keys (docs/communication.md).
"""

import contextlib
import datetime
import errno
import logging
import os
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hpcnet.agree import agree_on_error
from hpcnet.comm.netif import has_rdma_devices, interfaces
from hpcnet.comm.world import World
from hpcnet.errors import RestartableError, UsageError

log = logging.getLogger(__name__)


def _can_connect(address: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _listen(address: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``address`` alone (port 0: a free one from the kernel)."""
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((address, port), family=family, backlog=backlog)


@contextlib.contextmanager
def _probe_listeners(addresses: list[str]) -> Iterator[list[int | None]]:
    """Listen on each address for the reachability test; yield the ports (None: cannot listen there).

    The listeners live only for the test; a thread accepts and drops
    connections, so a thousand ranks testing at once never fill the listen
    queue and time out for no reason.
    """
    sockets: list[socket.socket] = []
    ports: list[int | None] = []
    for address in addresses:
        try:
            sockets.append(_listen(address))
            ports.append(sockets[-1].getsockname()[1])
        except OSError as exc:
            log.debug("cannot listen on %s for the reachability test: %s", address, exc)
            ports.append(None)
    stop = threading.Event()

    def accept() -> None:
        while sockets and not stop.is_set():
            ready, _, _ = select.select(sockets, [], [], 0.1)
            for sock in ready:
                with contextlib.suppress(OSError):
                    sock.accept()[0].close()

    thread = threading.Thread(target=accept, name="hpcnet-rendezvous-probe", daemon=True)
    thread.start()
    try:
        yield ports
    finally:
        stop.set()
        thread.join()
        for sock in sockets:
            sock.close()


def choose_address(comm: Any, world: World, *, interface: str = "") -> tuple[str, str]:
    """Collective: the rendezvous address (and interface name) every rank can reach.

    Args:
        comm: the communicator of the job.
        world: its layout.
        interface: a user-chosen interface name (``dist.interface``), or empty.
    """
    if world.num_nodes == 1 and not interface:
        return "127.0.0.1", "lo"
    error = None
    candidates: list[tuple[str, str]] = []
    if world.rank == 0:
        found = interfaces()
        if interface:
            found = [i for i in found if i.name == interface]
            if not found:
                error = UsageError(f"dist.interface: rank 0 on {world.hostname} has no interface {interface!r} "
                                   "that is up with an IPv4 address")
        candidates = [(i.address, i.name) for i in found]
        if not found and error is None:
            error = RestartableError(f"rank 0 on {world.hostname} has no usable network interface")
    agree_on_error(comm, error)
    candidates = comm.bcast(candidates, root=0)
    from mpi4py import MPI

    # Probe listeners, not the store: the store is bound to the chosen address
    # alone, so it can only start once the address is known.
    probes = _probe_listeners([a for a, _ in candidates]) if world.rank == 0 else contextlib.nullcontext([])
    with probes as ports:
        ports = comm.bcast(ports, root=0)
        for (address, name), port in zip(candidates, ports):
            ok = port is not None and (world.rank == 0 or _can_connect(address, port, timeout_s=2.0))
            if comm.allreduce(int(ok), op=MPI.MIN):
                return address, name
    raise RestartableError(
        f"no interface of rank 0 ({world.hostname}) is reachable from every rank; tried "
        + ", ".join(f"{n} ({a})" for a, n in candidates) + "; set dist.interface")


def _set_default_env(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = value
        log.debug("set %s=%s", name, value)


@dataclass(slots=True)
class DataPlane:
    """The torch.distributed process group hpcnet communicates gradients on."""

    backend: str
    address: str
    port: int
    interface: str
    group: Any
    store: Any

    def close(self) -> None:
        """Tear the process group down (idempotent)."""
        import torch.distributed as dist

        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None
        self.store = None


BACKENDS = ("nccl", "gloo")


def init_data_plane(comm: Any, world: World, *, backend: str, device: Any, timeout_s: float,
                    interface: str = "") -> DataPlane:
    """Collective: initialise torch.distributed's default group over the ranks of ``comm``.

    Args:
        comm: the MPI communicator whose ranks form the group (rank order kept).
        world: its layout (``hpcnet.comm.world.discover``).
        backend: 'nccl' or 'gloo': the group the transport plan needs
            (``hpcnet.comm.plan.Plan.torch_backend``), decided before.
        device: this rank's torch device.
        timeout_s: store and collective timeout.
        interface: network interface to use across nodes, or empty to choose.
    """
    import torch.distributed as dist

    if backend not in BACKENDS or (backend == "nccl" and device.type != "cuda"):
        raise ValueError(f"init_data_plane: backend {backend!r} on a {device.type} device")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    timeout = datetime.timedelta(seconds=timeout_s)
    env_addr = os.environ.get("MASTER_ADDR")
    if env_addr:
        address, ifname = env_addr, interface
    else:
        address, ifname = choose_address(comm, world, interface=interface)
    if ifname and (world.num_nodes > 1 or ifname == "lo"):
        # NCCL and gloo each pick an interface on their own (on one node, one
        # that other hosts can reach); make them use the one chosen here.
        _set_default_env("NCCL_SOCKET_IFNAME", ifname)
        _set_default_env("GLOO_SOCKET_IFNAME", ifname)
    if backend == "nccl" and not has_rdma_devices():
        _set_default_env("NCCL_IB_DISABLE", "1")
    store, port = _connect_store(comm, world, address, timeout)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL communicator creation
    error = None
    try:
        dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                                timeout=timeout, **kwargs)
    except Exception as exc:  # noqa: BLE001
        error = RestartableError(f"rank {world.rank}: init_process_group({backend!r}) failed: {exc}")
    agree_on_error(comm, error)
    log.info("torch.distributed %s: %d ranks, rendezvous %s:%d (%s)", backend, world.size, address, port, ifname)
    return DataPlane(backend, address, port, ifname, dist.group.WORLD, store)


def _connect_store(comm: Any, world: World, address: str, timeout: datetime.timedelta) -> tuple[Any, int]:
    """Collective: rank 0 starts the rendezvous store on ``address``, the others connect; (store, port)."""
    from torch.distributed import TCPStore

    store, port, error = _start_store(world, address, timeout) if world.rank == 0 else (None, 0, None)
    agree_on_error(comm, error)
    port = comm.bcast(port, root=0)
    try:
        if world.rank != 0:
            store = TCPStore(address, port, world.size, is_master=False, timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        error = RestartableError(f"rank {world.rank} on {world.hostname} cannot reach the rendezvous "
                                 f"store at {address}:{port}: {exc}")
    agree_on_error(comm, error)
    return store, port


def _start_store(world: World, address: str, timeout: datetime.timedelta) -> tuple[Any, int, BaseException | None]:
    """Rank 0: the store on ``address`` (``MASTER_PORT``, or a free port); (store, port, error to share)."""
    from torch.distributed import TCPStore

    env_addr, env_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    port = 0
    try:
        port = int(env_port) if env_port else 0
        # Bound to the chosen address only; the store takes over the socket.
        listener = _listen(address, port, backlog=max(world.size, 128))
        port = listener.getsockname()[1]
        store = TCPStore(address, port, world.size, is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=listener.detach())
        return store, port, None
    except (ValueError, OverflowError):
        return None, port, UsageError(f"MASTER_PORT={env_port!r} is not a port number")
    except OSError as exc:
        where = f"rank 0 on {world.hostname} cannot listen on {address}:{port} for the rendezvous store"
        if env_addr and (isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL):
            return None, port, UsageError(f"MASTER_ADDR={env_addr!r}: {where}: {exc.strerror or exc} "
                                          "(it must be an address of rank 0's host)")
        return None, port, RestartableError(f"{where}: {exc.strerror or exc}")
    except Exception as exc:  # noqa: BLE001 - shared with every rank by the caller
        return None, port, RestartableError(f"rank 0 could not start the rendezvous store on {address}:{port}: {exc}")
