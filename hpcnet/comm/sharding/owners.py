"""The owners in force: the cost model's assignment (``OwnerAssignment``: each unit's owner rank and the modelled
times) and the rank speeds it was chosen with.

Made at start-up (``assign_owners``), written by rank 0 to ``owners.json`` and saved in every checkpoint's meta
(``state``); a resume at the same world size goes on with the checkpoint's owners (``restore``), and with
``dist.owners=auto`` the ranks probe their speed again every ``dist.reassign_every`` steps and take new owners when
the speeds drifted and the cost model gains enough (``reassign``).  Moving what is owned (optimizer state, stage 3's
parameters, the buckets' layout) is the caller's: ``restore`` and ``reassign`` take it as ``move``, called on every
rank with the same new owners (collective), which returns the bytes of state moved by all ranks together.
"""

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcnet.comm.costmodel import LinkCost, OwnerAssignment, assignment_times_s, measured_speeds
from hpcnet.comm.sharding.assign import DEFAULT_LINK, UPDATE_S_PER_BYTE, assign_owners, measure_speed
from hpcnet.comm.sharding.layout import ShardLayout
from hpcnet.config import DistConfig
from hpcnet.observe.runlog import OptionalFile
from hpcnet.paths import OWNERS_FILE
from hpcnet.stateful import Entries, Saved, Stateful
from hpcnet.world import World

log = logging.getLogger(__name__)

REASSIGN_DRIFT = 0.25
"""dist.reassign_every: new owners are considered only when some rank's relative speed moved by more than this
fraction since the owners in force were chosen (the probe's noise on a shared node stays below it)."""
REASSIGN_GAIN = 0.10
"""... and taken only when the modelled step drops by more than this fraction (moving optimizer state costs a pass
over it)."""

Move = Callable[[OwnerAssignment], int]
"""Moves what is owned to new owners (collective); returns the bytes of state moved by all ranks together."""


class Owners(Stateful):
    """The owners of ``layout``'s units in force (see the module's doc); a part of the run whose checkpoint entry is
    the meta's ``shards`` (``hpcnet.stateful``).

    Args:
        layout: the units of ownership.
        comm: the ranks (choosing owners with ``dist.owners=auto`` gathers their speeds).
        world: its layout.
        cfg: the ``dist`` options (``zero``, ``owners``, ``reassign_every``).
        link: the probed link, or None (``DEFAULT_LINK``).
        device: where the speed probe runs.
        names: the trainable parameters' names, in layout order (``owners.json``).
    """

    def __init__(self, layout: ShardLayout, comm: Any, world: World, cfg: DistConfig, *, link: LinkCost | None,
                 device: torch.device, names: list[str]) -> None:
        self.layout, self.comm, self.world, self.cfg = layout, comm, world, cfg
        self.link, self.device, self.names = link, device, names
        self.assignment, self.speeds = assign_owners(layout.tensors, comm, mode=cfg.owners, link=link, device=device)
        self.reassignments = 0
        self.reassigning = False  # from ``start`` on, with dist.owners=auto and dist.reassign_every
        self._file: OptionalFile | None = None
        self._move: Move | None = None  # from ``start`` on: a resume may take a checkpoint's owners

    @property
    def owner(self) -> list[int]:
        return self.assignment.owner

    def start(self, run_dir: Path | None, move: Move) -> None:
        """The optimizer is sharded by these owners: rank 0 logs them and writes ``owners.json`` in ``run_dir``, and
        from now on ``after_step`` and a resume (``before_read``) may move them, by ``move``."""
        world, cfg = self.world, self.cfg
        self._move = move
        self._file = OptionalFile(run_dir / OWNERS_FILE) if run_dir is not None and world.is_main else None
        # At stage 3 new owners would gather the whole model on every rank: the start-up owners stay.
        self.reassigning = cfg.owners == "auto" and cfg.reassign_every > 0 and world.size > 1 and cfg.zero < 3
        if world.is_main:
            log.info("%s", self.describe())
        self.write()

    def write(self) -> None:
        """Rank 0 (re)writes owners.json; best effort (``OptionalFile``): the other ranks do not wait for it."""
        if self._file is not None:
            self._file.write_text(json.dumps(self.record(), indent=1) + "\n")

    def record(self) -> dict[str, Any]:
        """What owners.json holds: the stage, the mode, the inputs the cost model used and its assignment."""
        names = self.names
        units = []
        for unit, size, owner in zip(self.layout.units, self.layout.sizes, self.assignment.owner):
            entry = {"name": names[unit.param], "bytes": size, "owner": owner}
            if not unit.whole:
                entry["rows"] = [unit.lo, unit.hi]
            units.append(entry)
        link = self.link
        return {"zero": self.cfg.zero, "owners": self.cfg.owners, "world_size": self.world.size,
                "speeds": self.speeds,
                "link": ({"latency_us": link.latency_s * 1e6, "bandwidth_GBps": link.bandwidth_Bps / 1e9}
                         if link else None),
                "units": units, "cut": sorted({names[u.param] for u in self.layout.units if not u.whole}),
                **self.assignment.to_json()}

    def describe(self) -> str:
        mib = [b / 2**20 for b in self.assignment.rank_bytes]
        return (f"dist.zero={self.cfg.zero} (owners {self.cfg.owners}): parameters owned per rank "
                f"{', '.join(f'{m:.2f}' for m in mib[:8])}{' ...' if len(mib) > 8 else ''} MiB, "
                f"modelled imbalance {self.assignment.imbalance:.3f}; speeds "
                f"{', '.join(f'{s:.2f}' for s in self.speeds[:8])}{' ...' if len(self.speeds) > 8 else ''}")

    def state(self) -> dict[str, Any]:
        """The owners and the speeds they were chosen with, for a checkpoint's meta (``restore`` takes it back)."""
        return {"world_size": self.world.size, "owner": list(self.assignment.owner), "speeds": list(self.speeds),
                "bytes": list(self.layout.sizes), "units": self.layout.to_json()}

    def restore(self, saved: Any, move: Move) -> bool:
        """Go on with the owners a checkpoint was saved under (collective; every rank has the same meta).

        ``dist.owners=auto`` chooses owners from speeds measured at start-up, which differ from one start to the
        next; at stage 2 the owners decide how each bucket is reduce-scattered, and with more than 2 ranks MPI then
        adds the same numbers in another order.  Keeping the saved owners makes a resume at the same world size
        bit-identical to the run that was not interrupted.  Only a checkpoint of the same world size and unit
        sizes is followed; otherwise the fresh owners stay.  Returns whether the owners changed.
        """
        found = self._saved(saved)
        if found is None:
            return False
        owner, speeds = found
        if owner == self.assignment.owner:
            self.speeds = speeds
            return False
        sizes = self.layout.sizes
        times = assignment_times_s(sizes, owner, speeds, compute_s_per_byte=UPDATE_S_PER_BYTE,
                                   link=self.link or DEFAULT_LINK)
        rank_bytes = [0] * self.world.size
        for size, rank in zip(sizes, owner):
            rank_bytes[rank] += size
        moved = self._take(OwnerAssignment(owner, rank_bytes, times), speeds, move)
        if self.world.is_main:
            log.info("dist.owners: resumed with the checkpoint's owners (%.1f MiB of optimizer state moved): %s",
                     moved / 2**20, self.describe())
        self.write()
        return True

    def state_entries(self) -> Entries:
        """The owners in force, in the meta's ``shards`` (``state``)."""
        return Entries(meta={"shards": self.state()})

    def before_read(self, meta: dict[str, Any]) -> None:
        """Collective: go on with the owners the checkpoint was saved under (``restore``), so that each rank then
        reads the state it will own; nothing before the optimizer is sharded (``start``)."""
        if self._move is not None:
            self.restore(meta.get("shards"), self._move)

    def load_entries(self, saved: Saved) -> None:
        """Nothing left to take: the owners were taken before the read (``before_read``)."""

    def _saved(self, saved: Any) -> tuple[list[int], list[float]] | None:
        """The owners and speeds of a checkpoint's meta where they fit this run (same world size and units), else
        None."""
        if not isinstance(saved, dict):
            return None
        sizes, units, size = self.layout.sizes, self.layout.to_json(), self.world.size
        owner, speeds = saved.get("owner"), saved.get("speeds")
        if (saved.get("world_size") != size or saved.get("bytes") != sizes or saved.get("units", units) != units
                or not isinstance(owner, list) or len(owner) != len(sizes)
                or not all(isinstance(o, int) and 0 <= o < size for o in owner)
                or not isinstance(speeds, list) or len(speeds) != size
                or not all(isinstance(x, (int, float)) and 0 < x <= 1 for x in speeds)):
            return None
        return owner, [float(x) for x in speeds]

    def after_step(self, step: int, recorder: Any, move: Move) -> None:
        """Every ``dist.reassign_every`` steps while reassigning: the ranks probe their speed again and agree whether
        it calls for new owners (collective)."""
        if not self.reassigning or step % self.cfg.reassign_every:
            return
        # The start-up probe again, the same work on every rank: a rank's own update time would not do, as it
        # grows with what the rank owns, and a rank given less would look slower and be given less again.
        seconds = measure_speed(device=self.device)
        with recorder.op("reassign.allgather"):
            gathered = self.comm.allgather(seconds)
        self.reassign(step, measured_speeds(gathered), move)

    def reassign(self, step: int, speeds: list[float], move: Move) -> bool:
        """New owners when the ranks' relative ``speeds`` drifted by more than ``REASSIGN_DRIFT`` from those the
        owners in force were chosen with and the cost model gives a step more than ``REASSIGN_GAIN`` shorter
        (collective; the same decision on every rank from the same gathered figures).  Returns whether the owners
        changed."""
        if max(abs(new / old - 1) for new, old in zip(speeds, self.speeds)) <= REASSIGN_DRIFT:
            return False
        link = self.link or DEFAULT_LINK
        now = max(assignment_times_s(self.layout.sizes, self.assignment.owner, speeds,
                                     compute_s_per_byte=UPDATE_S_PER_BYTE, link=link))
        candidate, _ = assign_owners(self.layout.tensors, self.comm, mode="auto", link=self.link, speeds=speeds)
        if candidate.owner == self.assignment.owner or candidate.max_time_s >= (1 - REASSIGN_GAIN) * now:
            return False
        moved = self._take(candidate, speeds, move)
        self.reassignments += 1
        if self.world.is_main:
            log.info("dist.owners: new owners after step %d (measured update speeds %s; modelled step %.3f -> %.3f "
                     "ms; %.1f MiB of optimizer state moved): %s", step,
                     ", ".join(f"{x:.2f}" for x in speeds[:8]), 1e3 * now, 1e3 * candidate.max_time_s,
                     moved / 2**20, self.describe())
        self.write()
        return True

    def _take(self, assignment: OwnerAssignment, speeds: list[float], move: Move) -> int:
        moved = move(assignment)
        self.assignment, self.speeds = assignment, speeds
        return moved
