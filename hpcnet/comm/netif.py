"""The one lister of this host's network hardware: IPv4 interfaces (``/sys/class/net``) and RDMA ports
(``/sys/class/infiniband``).

The bootstrap picks the rendezvous/NCCL/gloo interface from ``interfaces()``; the topology probe reports
the same list (docs/communication.md, docs/topology.md).
"""

import fcntl
import fnmatch
import ipaddress
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYS_NET = Path("/sys/class/net")
SYS_INFINIBAND = Path("/sys/class/infiniband")

KINDS = ("loopback", "ipoib", "rdma", "ethernet", "virtual")
"""``ipoib``: IP over InfiniBand; ``rdma``: an Ethernet port of an RDMA device (RoCE); ``virtual``: a bridge or
veth, usually unreachable from other hosts."""

VIRTUAL_PREFIXES = ("docker", "virbr", "veth", "br-")
_ARPHRD_INFINIBAND, _ARPHRD_LOOPBACK = "32", "772"  # /sys/class/net/<name>/type
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_SIOCGIFNETMASK = 0x891B  # ... and its netmask


@dataclass(frozen=True, slots=True)
class Interface:
    """A network interface that is up and has an IPv4 address."""

    name: str
    address: str
    kind: str
    """One of ``KINDS``."""
    speed_mbps: int = -1
    """Link speed reported by the kernel; -1 when unknown (virtual links, IPoIB on some drivers)."""

    @property
    def infiniband(self) -> bool:
        """IPoIB, or an Ethernet port of an RDMA device: NCCL's InfiniBand transport can use it."""
        return self.kind in ("ipoib", "rdma")

    @property
    def virtual(self) -> bool:
        return self.kind == "virtual"

    def to_dict(self) -> dict:
        """The ``topology.json`` record (``hpcnet-topology/1``: the kind travels as ``infiniband``)."""
        return {"name": self.name, "address": self.address, "speed_mbps": self.speed_mbps,
                "infiniband": self.infiniband}

    @classmethod
    def from_dict(cls, data: dict) -> "Interface":
        """Inverse of ``to_dict``; an RDMA Ethernet port reads back as ``ipoib`` (the format has one bit)."""
        kind = kind_of(data["name"], link_type="", rdma_device=False)
        if data["infiniband"]:
            kind = "ipoib"
        return cls(data["name"], data["address"], kind, data["speed_mbps"])


def kind_of(name: str, *, link_type: str, rdma_device: bool) -> str:
    """The kind of interface ``name`` (pure logic).

    Args:
        name: its name.
        link_type: ``/sys/class/net/<name>/type`` (an ARPHRD number), or empty when unknown.
        rdma_device: its device has an ``infiniband`` directory (an RDMA adapter).
    """
    if link_type == _ARPHRD_LOOPBACK or name == "lo":
        return "loopback"
    if link_type == _ARPHRD_INFINIBAND or name.startswith("ib"):
        return "ipoib"
    if name.startswith(VIRTUAL_PREFIXES):
        return "virtual"
    return "rdma" if rdma_device else "ethernet"


def preference(iface: Interface) -> tuple:
    """Sort key, best first: virtual links last, then InfiniBand/RDMA, then by link speed, then name."""
    return (iface.virtual, not iface.infiniband, -iface.speed_mbps, iface.name)


def interfaces(sys_net: Path = SYS_NET, *, loopback: bool = False,
               address_of: Callable[[str], str | None] | None = None) -> list[Interface]:
    """Interfaces that are up with an IPv4 address, best first (``preference``).

    Args:
        sys_net: the ``/sys/class/net`` tree to read.
        loopback: include the loopback interface.
        address_of: an interface's IPv4 address, or None (default: asked of the kernel).
    """
    address_of = address_of or ipv4_address
    found = []
    for base in sorted(sys_net.iterdir()) if sys_net.is_dir() else []:
        if _read(base / "operstate") not in ("up", "unknown"):
            continue
        kind = kind_of(base.name, link_type=_read(base / "type"),
                       rdma_device=(base / "device" / "infiniband").exists())
        address = address_of(base.name) if loopback or kind != "loopback" else None
        if address is None:
            continue
        try:
            speed = int(_read(base / "speed"))
        except ValueError:
            speed = -1
        found.append(Interface(base.name, address, kind, speed))
    return sorted(found, key=preference)


def ipv4_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None."""
    return _ioctl_ipv4(name, _SIOCGIFADDR)


def ipv4_netmask(name: str) -> str | None:
    """The IPv4 netmask of interface ``name``, or None."""
    return _ioctl_ipv4(name, _SIOCGIFNETMASK)


def _ioctl_ipv4(name: str, request: int) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_source(address: str) -> str | None:
    """The local address the kernel sends from to reach ``address`` (``ip route get``), or None (no route).

    A UDP socket's ``connect`` picks the route and the source address without sending anything.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def parse_patterns(spec: str) -> list[str]:
    """``dist.interface``'s names: comma-separated, each a name or a glob pattern (``eth*,ens*``)."""
    return [p.strip() for p in spec.split(",") if p.strip()]


def matching(found: list[Interface], spec: str) -> list[Interface]:
    """The interfaces of ``found`` whose name matches one of ``spec``'s names or patterns (all when empty),
    in ``found``'s order."""
    patterns = parse_patterns(spec)
    if not patterns:
        return list(found)
    return [i for i in found if any(fnmatch.fnmatchcase(i.name, p) for p in patterns)]


def rendezvous_order(found: list[Interface], spec: str = "", prefer: str = "") -> list[Interface]:
    """The interfaces rank 0 offers for the rendezvous address, in the order it tries them (pure logic):
    those of ``found`` that ``spec`` (``dist.interface``) names, the one named ``prefer`` first, else in
    ``found``'s order."""
    return sorted(matching(found, spec), key=lambda i: i.name != prefer)  # stable


@dataclass(frozen=True, slots=True)
class Choice:
    """The interface a host uses to reach rank 0's rendezvous address, and why."""

    interface: Interface
    reason: str
    """``holds <address>``, ``same subnet as <address>``, ``route to <address>`` or ``named by dist.interface``."""


def interface_towards(target: str, spec: str = "", *, found: list[Interface] | None = None,
                      netmask_of: Callable[[str], str | None] | None = None,
                      source_of: Callable[[str], str | None] | None = None) -> Choice | None:
    """The interface of this host that reaches ``target`` (rank 0's rendezvous address), or None.

    In order: the one that holds ``target`` (rank 0's own host), the one whose subnet contains it, the one the
    kernel routes to it from (``route_source``); with ``spec`` (``dist.interface``) only among the interfaces it
    names, and when none of those reaches ``target`` by these rules, the first named one (the data plane then
    goes where the user said). None: no interface at all (with ``spec``: none that it names).

    Args:
        target: an IPv4 address (or a host name, resolved here).
        spec: ``dist.interface``: names or glob patterns, comma-separated; empty: any interface.
        found: this host's interfaces (default ``interfaces(loopback=True)``).
        netmask_of: an interface's netmask (default: asked of the kernel).
        source_of: the source address of the route to an address (default ``route_source``).
    """
    found = interfaces(loopback=True) if found is None else found
    netmask_of = netmask_of or ipv4_netmask
    source_of = source_of or route_source
    candidates = matching(found, spec)
    if not candidates:
        return None
    try:
        target = socket.gethostbyname(target)
        wanted = ipaddress.IPv4Address(target)
    except (OSError, ValueError):
        return Choice(candidates[0], "named by dist.interface") if spec else None
    for iface in candidates:
        if iface.address == target:
            return Choice(iface, f"holds {target}")
    for iface in candidates:
        mask = netmask_of(iface.name)
        if mask and mask != "0.0.0.0" and wanted in ipaddress.IPv4Network(f"{iface.address}/{mask}", strict=False):
            return Choice(iface, f"same subnet as {target}")
    source = source_of(target)
    for iface in candidates:
        if source is not None and iface.address == source:
            return Choice(iface, f"route to {target}")
    if spec:
        return Choice(candidates[0], "named by dist.interface")
    return None


@dataclass(kw_only=True, slots=True)
class IbPort:
    """One port of an RDMA device under /sys/class/infiniband (InfiniBand or RoCE)."""

    device: str
    """HCA name, e.g. ``mlx5_0``."""
    port: int
    state: str
    """``ACTIVE`` when usable."""
    rate_gbps: float
    """Signalling rate in Gbit/s; 0 when unknown."""
    link_layer: str
    """``InfiniBand``, or ``Ethernet`` for RoCE."""


def ib_ports(sys_ib: Path = SYS_INFINIBAND) -> list[IbPort]:
    """Ports of the RDMA devices under /sys/class/infiniband (empty when there are none)."""
    found = []
    for device in sorted(sys_ib.glob("*")) if sys_ib.is_dir() else []:
        for port in sorted((device / "ports").glob("*")):
            try:  # "100 Gb/sec (4X EDR)"
                rate = float(_read(port / "rate").split()[0])
            except (IndexError, ValueError):
                rate = 0.0
            found.append(IbPort(device=device.name, port=int(port.name) if port.name.isdigit() else 0,
                                state=_read(port / "state").split(":", 1)[-1].strip(),  # "4: ACTIVE"
                                rate_gbps=rate, link_layer=_read(port / "link_layer") or "InfiniBand"))
    return found


def has_rdma_devices(sys_ib: Path = SYS_INFINIBAND) -> bool:
    """An RDMA device is present (NCCL's InfiniBand transport may work)."""
    return sys_ib.exists()


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
