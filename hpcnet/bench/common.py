"""Helpers shared by the benchmarks: sizes, bandwidth formulas, link counters, robust statistics, tables, a
watched process.

The formulas and the parsing are pure functions (tested on one process); the
few helpers that communicate take the communicator as a parameter.
"""

import json
import os
import platform
import re
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_size(text: str) -> int:
    """Bytes from '4096', '64KiB', '25MiB', '1.5G' (K/M/G without 'B' are binary, KB/MB/GB decimal)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64KiB, 25MiB, 1GiB)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value != int(value) or value <= 0:
        raise ValueError(f"a size must be a positive whole number of bytes, got {text!r}")
    return int(value)


def format_size(nbytes: int) -> str:
    """'1KiB', '25MiB', '1.5MiB', '1000B': the shortest exact-ish binary form."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            value = nbytes / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{nbytes}B"


def size_sweep(min_bytes: int, max_bytes: int, factor: int, extra: tuple[int, ...] = ()) -> list[int]:
    """Sizes min, min*factor, ... up to max, plus ``extra`` sizes within the range, sorted and unique."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min size <= max size, got {min_bytes} and {max_bytes}")
    if factor < 2:
        raise ValueError(f"the size factor must be at least 2, got {factor}")
    sizes = set()
    size = min_bytes
    while size <= max_bytes:
        sizes.add(size)
        size *= factor
    sizes.update(s for s in extra if min_bytes <= s <= max_bytes)
    return sorted(sizes)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s (nccl-tests): the buffer size over the time of one operation."""
    return nbytes / seconds


def busbw(nbytes: int, seconds: float, world_size: int) -> float:
    """AllReduce bus bandwidth in bytes/s (nccl-tests): algbw * 2(n-1)/n, comparable across rank counts."""
    return algbw(nbytes, seconds) * 2 * (world_size - 1) / world_size


SYS_CLASS_NET = Path("/sys/class/net")
"""This process's network interfaces: those of its network namespace (``ip netns exec``, which the local cluster's
agent uses, mounts a sysfs of the namespace it enters)."""
ARPHRD_LOOPBACK = 772
"""``<if>/type`` of a loopback interface."""


def _read_int(path: Path) -> int | None:
    """The integer in a sysfs file; None when it is missing or unreadable (``speed`` of a virtual link: EINVAL)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def net_interfaces(root: Path = SYS_CLASS_NET) -> list[str]:
    """The non-loopback interfaces under ``root`` (a sysfs ``class/net`` directory), sorted; none if unreadable.
    Bridges and veths named as such (docker0, veth*, ``hpcnet.comm.netif.VIRTUAL_PREFIXES``) are left out: their
    bytes also pass a physical interface, and would be counted twice."""
    from hpcnet.comm.netif import VIRTUAL_PREFIXES

    try:
        names = sorted(entry.name for entry in root.iterdir())
    except OSError:
        return []
    return [name for name in names if name != "lo" and not name.startswith(VIRTUAL_PREFIXES)
            and _read_int(root / name / "type") != ARPHRD_LOOPBACK]


def net_counters(root: Path = SYS_CLASS_NET) -> dict[str, tuple[int, int]]:
    """``{interface: (tx_bytes, rx_bytes)}`` over the non-loopback interfaces under ``root``; an interface whose
    counters cannot be read is left out."""
    counters = {}
    for name in net_interfaces(root):
        stats = root / name / "statistics"
        tx, rx = _read_int(stats / "tx_bytes"), _read_int(stats / "rx_bytes")
        if tx is not None and rx is not None:
            counters[name] = (tx, rx)
    return counters


def counter_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """Bytes ``(sent, received)`` between two ``net_counters`` readings, summed over the interfaces in both (one
    that came or went in between is left out; a counter that went back, a recreated interface, adds 0)."""
    sent = received = 0
    for name in before.keys() & after.keys():
        sent += max(0, after[name][0] - before[name][0])
        received += max(0, after[name][1] - before[name][1])
    return sent, received


def link_speed_gbit(root: Path = SYS_CLASS_NET) -> tuple[float, str] | None:
    """The slowest non-loopback interface under ``root``: its ``speed`` (Mbit/s) in Gbit/s, and its name; None when
    no interface reports a speed (virtual ones often report none, or -1).  A tc rate limit does not show here."""
    speeds = []
    for name in net_interfaces(root):
        mbit = _read_int(root / name / "speed")
        if mbit is not None and mbit > 0:
            speeds.append((mbit / 1000, name))
    return min(speeds) if speeds else None


def link_floor_s(gradient_bytes: int, hosts: int, link_gbit: float) -> float:
    """Seconds an exact hierarchical all-reduce of ``gradient_bytes`` needs on links of ``link_gbit`` Gbit/s:
    every host sends ``gradient_bytes * 2 (hosts-1)/hosts`` out of its link once (a host's share of a ring
    all-reduce among the hosts); 0 on one host."""
    if hosts < 1:
        raise ValueError(f"hosts must be at least 1, got {hosts}")
    if link_gbit <= 0:
        raise ValueError(f"the link speed must be positive, got {link_gbit} Gbit/s")
    return gradient_bytes * 2 * (hosts - 1) / hosts / (link_gbit * 1e9 / 8)


def summarize(values: list[float]) -> dict[str, float]:
    """Median and spread (min, max, and max-min relative to the median) of per-round figures."""
    if not values:
        raise ValueError("no values to summarize")
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / median if median else 0.0}


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def bound_cpus() -> int:
    """CPUs this process may run on (mpirun binds each rank to one core by default)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def environment(comm: Any) -> dict[str, Any]:
    """What a reader needs to judge the figures: host, cores, load, library versions (collective)."""
    import torch
    from mpi4py import MPI

    hosts = comm.allgather(platform.node())
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hosts": sorted(set(hosts)),
        "world_size": comm.Get_size(),
        "cores_per_host": os.cpu_count() or 1,
        "cpus_bound_per_rank": comm.allgather(bound_cpus()),
        "load_average_start": load_average(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "mpi_library": MPI.Get_library_version().strip("\x00 \n").splitlines()[0].rstrip(", "),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def describe_environment(env: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.2f}" for x in env["load_average_start"])
    return (f"{env['world_size']} ranks on {len(env['hosts'])} host(s) ({', '.join(env['hosts'][:4])}), "
            f"{env['cores_per_host']} cores/host, CPUs bound per rank {env['cpus_bound_per_rank']}, "
            f"torch threads/rank {env['torch_threads']}, load average {load} (1/5/15 min) at start\n"
            f"torch {env['torch']}, mpi4py {env['mpi4py']}, {env['mpi_library']}"
            + (f", GPU {env['cuda']}" if env["cuda"] else ""))


def table(header: list[str], rows: list[list[str]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for k, row in enumerate([header, *rows]):
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically (a reader never sees half a file)."""
    target = Path(path)
    if target.parent != Path(""):
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, target)


def max_over_ranks(comm: Any, seconds: float) -> float:
    """The slowest rank's time (collective): a collective is done when the last rank is done."""
    from mpi4py import MPI

    return comm.allreduce(seconds, op=MPI.MAX)


def step_times(path: Path) -> dict[int, float]:
    """Step -> unix time it was logged, from a metrics JSON-lines file (training lines only)."""
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record and "time" in record:
            out.setdefault(int(record["step"]), float(record["time"]))
    return out


class Watched:
    """A process (``python -m hpcnet.launch ...``, say) whose merged output is read, with the time of each line,
    as it comes. ``env``: its environment (None: this process's)."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def said(self, pattern: str, after: float = 0.0) -> float | None:
        """When a line matching the regular expression ``pattern`` first came (at ``after`` or later); None if
        none has."""
        regex = re.compile(pattern)
        return next((when for when, line in list(self.lines) if when >= after and regex.search(line)), None)

    def wait_for(self, pattern: str, after: float, timeout_s: float) -> float:
        """When a line matching ``pattern`` came (at ``after`` or later), waiting up to ``timeout_s`` for it;
        RuntimeError with the last lines if none came first or the process ended without one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            when = self.said(pattern, after)
            if when is not None:
                return when
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {pattern!r} within {timeout_s} s:\n{''.join(text for _, text in self.lines[-30:])}")

    def stop(self) -> None:
        """End it if it still runs: SIGTERM first (the supervisor ends its attempt's launcher), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
