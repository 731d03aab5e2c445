"""The exact-fit request router for Ray Serve: the ledger (routing/ledger.py) behind Serve's
`RequestRouter` interface.

Serve builds the router inside the process that holds the handle (the ingress), on a loop of its own.
The ingress sizes each request (request_sizer.py) and calls the engine deployment with `need` (blocks per
pool, None when it could not size it) and `routed_id`; `choose_replicas` places it on the replica the
ledger picks and records the placement at once, so concurrent routing tasks never count the same
free blocks twice. When no replica has room now it waits here, woken by a finish, a report or a
change of replicas (with a short timeout as a floor), instead of Serve's blind retries with back-off;
how many may wait is the ingress's bound (its 429). Replicas report through `record_routing_stats`
(server/router_replica.py), which Serve polls every `ROUTING_STATS_PERIOD_S`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Serve pickles this module by value into the handle's process: the ledger registry lives in
# routing/ledger.py,
# imported by reference, so the router and the ingress there share one ledger.
from widebeam.routing.ledger import ReplicaReport, shared_ledger

ROUTING_STATS_PERIOD_S = 0.5  # the floor is once a second
WAIT_FLOOR_S = 0.5  # a held request looks again at least this often, whatever wakes it
MAX_ROUTING_TASKS = 512  # above the ingress's default bound on held requests (256)

def replica_key(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class ExactFitRequestRouter(RequestRouter):
    @property
    def max_num_routing_tasks(self) -> int:
        # Serve runs at most 2 routing tasks per replica, each routing the oldest request it can get:
        # requests waiting here for room would block every smaller one behind them. One task per
        # held request (the ingress bounds how many) lets a request that fits go ahead, within the
        # ledger's starvation guard (`PlacementLedger.may_place`).
        return max(2 * len(self._replicas), MAX_ROUTING_TASKS)

    def initialize_state(self, **kwargs: Any) -> None:
        self.ledger = shared_ledger(self._deployment_id.name)
        self._changed: asyncio.Event | None = None
        self._request_to_routed: dict[str, str] = {}  # Serve's internal request id -> the ingress's id

    # -- what changes the room ---------------------------------------------------------------------
    def _wake(self) -> None:
        if self._changed is not None:
            self._event_loop.call_soon_threadsafe(self._changed.set)

    def _read_reports(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            report = ReplicaReport.from_stats(replica.routing_stats)
            self.ledger.report(replica_key(replica.replica_id), report)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.ledger.set_replicas(replica_key(r.replica_id) for r in replicas)
        self._read_reports(replicas)
        self._wake()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.ledger.remove_replica(replica_key(replica_id))  # its requests fail at the ingress
        self._wake()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed_id = self._request_to_routed.pop(internal_request_id, None)
        if routed_id is not None:
            self.ledger.release(routed_id)
            self._wake()

    # -- the choice --------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        routed_id = kwargs.get("routed_id")
        if routed_id is None:  # a call the ingress did not place (none today): any replica
            return [candidate_replicas]
        if self._changed is None:
            self._changed = asyncio.Event()
        need = kwargs.get("need")
        while True:
            self._read_reports(candidate_replicas)
            self._changed.clear()
            chosen = self.ledger.choose(need, among=by_key) if self.ledger.may_place(routed_id) else None
            if chosen is not None:
                self.ledger.place(routed_id, chosen, need, held_id=routed_id)
                self._request_to_routed[pending_request.metadata.internal_request_id] = routed_id
                self._wake()  # a held request the starvation guard kept back may go now
                return [[by_key[chosen]]]
            if not self.ledger.reports:  # no replica has reported yet: Serve's own wait, with back-off
                # (Serve loops at once on an empty choice unless told to back off)
                pending_request.routing_context.should_backoff = True
                return []
            try:
                await asyncio.wait_for(self._changed.wait(), WAIT_FLOOR_S)
            except TimeoutError:
                pass
            by_key = {replica_key(r.replica_id): r for r in self._replicas_list}
            candidate_replicas = list(by_key.values())
