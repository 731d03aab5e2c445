"""Where a request goes among replicas: by its exact per-pool block need against each replica's room.

The ledger is the router's memory between reports. Each replica reports its pools (`capacity_blocks`:
what requests can ever reserve, pinned blocks left out) and its own count of what a new request could
reserve now (`headroom_blocks`: free and evictable blocks less what its admitted and waiting requests
may still take), stamped with the replica's clock. Reports come at most once a period, so the ledger
also keeps every request it has placed and not yet seen finish, with its need, and counts a replica's
room two ways, taking the smaller:

- by the ledger alone: `capacity - sum(need of the requests placed there and not finished)`. The
  router is the only way in, and a need is an exact upper bound (kv/budget.py), so while this stays
  >= 0 every request placed there can hold its blocks at once: the replica admits it without waiting.
- by the last report less the needs placed after it was taken: catches blocks held by work the ledger
  does not size (catalogue-constrained searches and scoring, sized by the replica itself).

Two requests placed between two reports are both in the ledger, so they are never counted against the
same free blocks. A request that fits no replica now waits at the router (the caller holds it; see
`num_held`); one that no replica could ever hold is refused before it reaches one (by the ingress's sizer).
Pure Python, no Ray: the Ray Serve router (server/ray_router.py) drives it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from widebeam.sched.scheduler import MAX_OVERTAKES


@dataclass(frozen=True)
class ReplicaReport:
    capacity_blocks: Mapping[str, int]
    headroom_blocks: Mapping[str, int]
    taken_at_s: float  # the replica's time.time() when it counted
    metrics_text: str = ""  # the replica's Prometheus text, for the router's /metrics

    @classmethod
    def from_stats(cls, stats: Mapping) -> ReplicaReport | None:
        """A report from a replica's routing stats (`record_routing_stats`), None when it has none yet."""
        if not stats or "capacity_blocks" not in stats:
            return None
        return cls(dict(stats["capacity_blocks"]), dict(stats["headroom_blocks"]), float(stats["taken_at_s"]),
                   stats.get("metrics_text", ""))


@dataclass
class Placement:
    replica_id: str
    need: Mapping[str, int]  # {} for a request the ingress could not size
    placed_at_s: float
    released_at_s: float | None = None


@dataclass
class PlacementLedger:
    replica_ids: list[str] = field(default_factory=list)
    reports: dict[str, ReplicaReport] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)  # request id -> where it went
    # requests waiting at the router for room, oldest first, with how often a newer one went ahead
    held: dict[str, int] = field(default_factory=dict)
    # finished placements a replica's last report may still count (kept until a later report)
    released: list[Placement] = field(default_factory=list)
    # The pools of a replica that has not reported yet (replicas share one configuration; the ingress
    # sets it from a replica's sizer): a new replica is placed on at once, counted by the ledger alone.
    default_capacity_blocks: dict[str, int] | None = None
    # the router's loop and the ingress's share the ledger
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    # -- what the replicas say ---------------------------------------------------------------------
    def set_replicas(self, replica_ids: Iterable[str]) -> list[str]:
        """The replicas now running; placements on one that left are dropped (returned)."""
        with self.lock:
            self.replica_ids = list(replica_ids)
            gone = set(self.reports) - set(self.replica_ids)
            dropped = []
            for replica_id in gone:
                dropped += self.remove_replica(replica_id)
            return dropped

    def report(self, replica_id: str, report: ReplicaReport | None) -> None:
        if report is None:
            return
        with self.lock:
            last = self.reports.get(replica_id)
            if last is None or report.taken_at_s >= last.taken_at_s:  # reports can arrive out of order
                self.reports[replica_id] = report
                oldest = min((r.taken_at_s for r in self.reports.values()), default=0.0)
                self.released = [p for p in self.released if p.released_at_s > oldest]

    def remove_replica(self, replica_id: str) -> list[str]:
        """A replica died: forget its report and drop its placements (their requests end with an error
        at the caller); returns the dropped request ids."""
        with self.lock:
            self.reports.pop(replica_id, None)
            if replica_id in self.replica_ids:
                self.replica_ids.remove(replica_id)
            dropped = [rid for rid, p in self.placements.items() if p.replica_id == replica_id]
            for request_id in dropped:
                del self.placements[request_id]
            return dropped

    # -- the room ----------------------------------------------------------------------------------
    def _placed_on(self, replica_id: str) -> list[Placement]:
        return [p for p in self.placements.values() if p.replica_id == replica_id]

    def _report_of(self, replica_id: str) -> ReplicaReport | None:
        report = self.reports.get(replica_id)
        if report is None and self.default_capacity_blocks is not None and replica_id in self.replica_ids:
            return ReplicaReport(self.default_capacity_blocks, self.default_capacity_blocks, 0.0)
        return report

    def headroom_blocks(self, replica_id: str) -> dict[str, int]:
        """Per pool, what a new request could reserve on the replica now (the smaller of the two counts)."""
        with self.lock:
            report = self._report_of(replica_id)
            placed = self._placed_on(replica_id)
            room = {}
            # finished since the report, placed before it: the report still counts their blocks
            freed = [p for p in self.released if p.replica_id == replica_id
                     and p.placed_at_s <= report.taken_at_s < p.released_at_s]
            for pool, capacity in report.capacity_blocks.items():
                by_ledger = capacity - sum(p.need.get(pool, 0) for p in placed)
                by_report = (report.headroom_blocks.get(pool, capacity)
                             - sum(p.need.get(pool, 0) for p in placed if p.placed_at_s > report.taken_at_s)
                             + sum(p.need.get(pool, 0) for p in freed))
                room[pool] = min(by_ledger, by_report)
            return room

    def clip_to_capacity(self, need: Mapping[str, int]) -> dict[str, int]:
        """A call of several engine requests, each of which fits a replica, may need more than any one
        replica holds: it is placed whole on one, where its requests queue for each other as on a single
        server, so it books at most the largest capacity of each pool."""
        with self.lock:
            largest: dict[str, int] = {}
            for report in self.reports.values():
                for pool, capacity in report.capacity_blocks.items():
                    largest[pool] = max(largest.get(pool, 0), capacity)
            return {pool: min(blocks, largest.get(pool, blocks)) for pool, blocks in need.items()}

    def choose(self, need: Mapping[str, int] | None, among: Iterable[str] | None = None) -> str | None:
        """The replica to place `need` on now: of those where it fits in every pool, the one left with
        the most room (its tightest pool's share of capacity after placing), then the fewest requests
        placed. `need` None (a request the caller could not size): the replica with the most room.
        None when it fits nowhere now."""
        with self.lock:
            candidates = [r for r in (self.replica_ids if among is None else among)
                          if self._report_of(r) is not None]
            best, best_key = None, None
            for replica_id in candidates:
                room = self.headroom_blocks(replica_id)
                capacity = self._report_of(replica_id).capacity_blocks
                left = {pool: room[pool] - (need or {}).get(pool, 0) for pool in room}
                if need is not None and any(blocks < 0 for blocks in left.values()):
                    continue
                share = min((left[pool] / max(capacity[pool], 1) for pool in left), default=0.0)
                key = (share, -len(self._placed_on(replica_id)))
                if best_key is None or key > best_key:
                    best, best_key = replica_id, key
            return best

    # -- the requests ------------------------------------------------------------------------------
    def hold(self, request_id: str) -> None:
        with self.lock:
            self.held.setdefault(request_id, 0)

    def unhold(self, request_id: str) -> None:
        with self.lock:
            self.held.pop(request_id, None)

    def may_place(self, request_id: str) -> bool:
        """The starvation guard, the engine's own (sched/scheduler.py: MAX_OVERTAKES): a held request may
        go ahead of older held ones, each of which only so often; then nothing newer goes ahead of it."""
        with self.lock:
            for older, overtakes in self.held.items():
                if older == request_id:
                    return True
                if overtakes >= MAX_OVERTAKES:
                    return False
            return True

    @property
    def num_held(self) -> int:
        return len(self.held)

    def place(self, request_id: str, replica_id: str, need: Mapping[str, int] | None,
              now_s: float | None = None, held_id: str | None = None) -> None:
        """Record that `request_id` was sent to `replica_id` (it stops waiting at the router)."""
        with self.lock:
            self.placements[request_id] = Placement(replica_id, dict(need or {}),
                                                    time.time() if now_s is None else now_s)
            if held_id is not None and held_id in self.held:
                for older in self.held:  # each older held request was overtaken once more
                    if older == held_id:
                        break
                    self.held[older] += 1
                del self.held[held_id]

    def release(self, request_id: str, now_s: float | None = None) -> Placement | None:
        """The request finished (or failed) at its replica: its blocks are the replica's again."""
        with self.lock:
            placement = self.placements.pop(request_id, None)
            if placement is not None:
                placement.released_at_s = time.time() if now_s is None else now_s
                self.released.append(placement)
            return placement


_LEDGERS: dict[str, PlacementLedger] = {}
_LEDGERS_LOCK = threading.Lock()


def shared_ledger(deployment_name: str) -> PlacementLedger:
    """The ledger of a deployment in this process: the ingress (holds, releases) and the router
    (places) share it."""
    with _LEDGERS_LOCK:
        return _LEDGERS.setdefault(deployment_name, PlacementLedger())
