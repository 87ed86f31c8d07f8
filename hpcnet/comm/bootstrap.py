"""Bring up torch.distributed from MPI: no MASTER_ADDR, no hostfile, no guessing.

Rank 0 picks the rendezvous address deliberately (loopback when every rank
shares one node; otherwise the first of its interfaces, in ``netif``'s order
(IPoIB and RDMA first), that *every* rank can actually connect to, tested over
TCP against short-lived probe listeners),
then starts the TCPStore on a socket bound to that address alone, on a free
port the kernel gives it, so there is no race for a port and nothing listens
on the other interfaces.  The address and port travel to the other ranks
over MPI.  ``MASTER_ADDR``/``MASTER_PORT`` win when the user sets them.

Each host then picks its own interface towards that address (``netif.interface_towards``: the one that holds
it, else the one on its subnet, else the one the kernel routes through), and its ranks set
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` to it: hosts of different kinds name their interfaces
differently.  Rank 0 logs one line per host.

Every phase here runs under a start-up deadline (``dist.startup_timeout_s``, ``hpcnet.fault.watchdog``):
a rank that never arrives ends the job with status 75 and a report naming the phase and the missing ranks.

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

from hpcnet.agree import agree_on_error, mark_agreed
from hpcnet.comm.netif import Interface, has_rdma_devices, interface_towards, interfaces, rendezvous_order
from hpcnet.errors import RestartableError, UsageError
from hpcnet.fault.watchdog import NULL_DEADLINES, STARTUP_OPTION, startup_phase
from hpcnet.world import World

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


def choose_address(comm: Any, world: World, *, interface: str = "", prefer: str = "") -> tuple[str, str]:
    """Collective: the rendezvous address (and rank 0's interface name) every rank can reach.

    Args:
        comm: the communicator of the job.
        world: its layout.
        interface: ``dist.interface``: names or glob patterns, comma-separated, or empty.
        prefer: an interface name to try first on rank 0 (the probe's advice), or empty.
    """
    if world.num_nodes == 1 and not interface:
        return "127.0.0.1", "lo"
    error = None
    candidates: list[tuple[str, str]] = []
    if world.rank == 0:
        found = rendezvous_order(interfaces(), interface, prefer)
        if interface and not found:
            error = UsageError(f"dist.interface={interface!r}: rank 0 on {world.hostname} has no interface it "
                               "names that is up with an IPv4 address")
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


SET_ENV: dict[str, str] = {}
"""The variables this process's data plane set (and their values): ``DataPlane.close`` takes them back, and a
process that starts jobs of its own (the tests) leaves them out of their environment, where they would pin
another job's sockets to this one's interface."""


def _set_default_env(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = value
        SET_ENV[name] = value
        log.debug("set %s=%s", name, value)


def unset_own_env() -> None:
    """Take back the variables the data plane set (``SET_ENV``) that still hold what it set."""
    for name, value in SET_ENV.items():
        if os.environ.get(name) == value:
            del os.environ[name]
    SET_ENV.clear()


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
        unset_own_env()

    def abort(self) -> None:
        """Let the process groups go without waiting for a peer (peers were lost: ``hpcnet.fault.live``): every group
        aborted, torch.distributed left ready for a new default group (idempotent)."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _abort_process_group

        if self.group is not None and dist.is_initialized():
            _abort_process_group()
        self.group = None
        self.store = None
        unset_own_env()


BACKENDS = ("nccl", "gloo")


def host_interfaces(comm: Any, world: World, address: str, spec: str = "") -> Interface | None:
    """Collective: this host's interface towards ``address`` (rank 0's rendezvous address), chosen per host.

    Rank 0 logs one line per host.  A host that has none of the interfaces ``spec`` (``dist.interface``) names
    is a ``UsageError`` naming the host and its ranks, raised on every rank.  None: no interface found (without
    ``spec``): gloo and NCCL choose on that host.
    """
    try:
        choice = interface_towards(address, spec)
        have = sorted(i.name for i in interfaces(loopback=True))
        mine = ((choice.interface.name, choice.interface.address, choice.reason) if choice else None, have)
    except Exception as exc:  # noqa: BLE001 - shared below: every rank decides alike
        choice, mine = None, (None, [f"error: {exc}"])
    every = comm.allgather(mine)
    hosts: dict[str, list[int]] = {}
    for rank, host in enumerate(world.hostnames):
        hosts.setdefault(host, []).append(rank)
    def which(ranks: list[int]) -> str:
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))

    missing = [h for h, ranks in hosts.items() if spec and every[ranks[0]][0] is None]
    if missing:
        lines = [f"host {h} ({which(hosts[h])}) has none of them; its interfaces: "
                 f"{', '.join(every[hosts[h][0]][1]) or 'none'}" for h in missing]
        raise mark_agreed(UsageError(f"dist.interface={spec!r}: " + "; ".join(lines)))
    if world.rank == 0:
        for host, ranks in hosts.items():
            chosen = every[ranks[0]][0]
            what = (f"{chosen[0]} {chosen[1]} ({chosen[2]})" if chosen else
                    f"none found towards {address}: gloo and NCCL choose")
            log.info("network interface on %s (%s): %s", host, which(ranks), what)
    return choice.interface if choice else None


def init_data_plane(comm: Any, world: World, *, backend: str, device: Any, timeout_s: float,
                    interface: str = "", prefer: str = "", deadlines: Any = NULL_DEADLINES,
                    startup_timeout_s: float = 120.0) -> DataPlane:
    """Collective: initialise torch.distributed's default group over the ranks of ``comm``.

    Args:
        comm: the MPI communicator whose ranks form the group (rank order kept).
        world: its layout (``hpcnet.world.discover``).
        backend: 'nccl' or 'gloo': the group the route needs
            (``hpcnet.comm.route.Route.torch_backend``), decided before.
        device: this rank's torch device.
        timeout_s: store and collective timeout.
        interface: ``dist.interface``: the interfaces to use (names or glob patterns, comma-separated; every
            host must have one), or empty to choose.
        prefer: the interface name rank 0 tries first for the rendezvous address (the probe's advice).
        deadlines: this rank's guarded waits (``Monitor.deadlines``): the rendezvous and the first
            collective each run under ``startup_timeout_s`` (``dist.startup_timeout_s``).
        startup_timeout_s: that deadline, per phase.
    """
    import torch.distributed as dist

    if backend not in BACKENDS or (backend == "nccl" and device.type != "cuda"):
        raise ValueError(f"init_data_plane: backend {backend!r} on a {device.type} device")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    timeout = datetime.timedelta(seconds=timeout_s)
    # Open by hand, not ``with``: a rank whose init_process_group failed leaves the phase before it waits to
    # share the error, so the report names it as not arrived while the others still wait to connect to it.
    guard = deadlines.open("dist.rendezvous", startup_timeout_s, kind="startup", option=STARTUP_OPTION,
                           what="the rendezvous (address, TCPStore, init_process_group)")
    try:
        env_addr = os.environ.get("MASTER_ADDR")
        if env_addr:
            address = env_addr
        else:
            address, _ = choose_address(comm, world, interface=interface, prefer=prefer)
        # NCCL and gloo each pick an interface on their own (on one node, one that other hosts can reach;
        # elsewhere whatever the host name resolves to): make them use this host's one towards rank 0.
        local = (Interface("lo", "127.0.0.1", "loopback") if address == "127.0.0.1" and world.num_nodes == 1
                 else host_interfaces(comm, world, address, interface))
        ifname = local.name if local else ""
        if ifname:
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
            error = RestartableError(f"rank {world.rank} on {world.hostname}: init_process_group({backend!r}) "
                                     f"failed: {exc}")
            # Said now: the ranks that did connect wait in the rendezvous until the start-up deadline.
            log.error("%s", error)
            deadlines.close(guard)
        agree_on_error(comm, error)
    finally:
        deadlines.close(guard)
    with startup_phase(deadlines, "dist.first", startup_timeout_s, "the first collective on the data plane"):
        _first_collective(device)
    log.info("torch.distributed %s: %d ranks, rendezvous %s:%d (%s on this host)", backend, world.size, address,
             port, ifname or "chosen by the backend")
    return DataPlane(backend, address, port, ifname, dist.group.WORLD, store)


def _first_collective(device: Any) -> None:
    """An all-reduce of one element on the new group: every pair of ranks can talk before anything relies on it."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1, device=device))


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
