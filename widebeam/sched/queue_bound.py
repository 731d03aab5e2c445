"""The waiting queue's bound: past it a request is refused at once (a server's 429 with `Retry-After`),
never queued to wait silently.

Two bounds, each optional: the number of waiting requests (`max_waiting_requests`), and per pool the
blocks the waiting requests will reserve when admitted (`max_waiting_blocks`: their `required_blocks`
summed; a W=256 search over a long prompt weighs what it will hold, not 1). A refused request holds
nothing: the check runs before anything of it is allocated or queued. Offline batches (`LLM.generate`)
queue every prompt at once, so the engine's default is unbounded; `widebeam serve` bounds it.

`Retry-After` is the time the queue ahead of the request should take to drain at the rate requests
finished recently (the last `RATE_WINDOW` finishes), at least 1 s and at most `MAX_RETRY_AFTER_S`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping, Sequence

from widebeam.errors import InvalidParameterError, QueueFullError

RATE_WINDOW = 64  # finishes the drain rate is measured over
MAX_RETRY_AFTER_S = 60
DEFAULT_RETRY_AFTER_S = 1  # before two requests have finished


def check_group_size(num_requests: int, max_waiting_requests: int | None) -> None:
    """A call of `num_requests` engine requests (an HTTP request with `n` sampled choices) queues them all
    at once: past `max_waiting_requests` it could never be queued, whatever the load, so it is invalid
    (a 400), not a 429 to retry."""
    if max_waiting_requests is not None and num_requests > max_waiting_requests:
        raise InvalidParameterError(
            "n", "{n} asks for {num} sequences, each its own request in the waiting queue, which holds at "
            "most {bound} (max_waiting_requests): it could never be queued; ask for at most {bound}",
            num=num_requests, bound=max_waiting_requests)


class WaitingQueueBound:
    def __init__(self, max_waiting_requests: int | None = None, max_waiting_blocks: int | None = None):
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_blocks = max_waiting_blocks
        self._finish_times_s: deque[float] = deque(maxlen=RATE_WINDOW)
        self.num_refused = 0

    def record_finish(self, now_s: float | None = None) -> None:
        self._finish_times_s.append(time.monotonic() if now_s is None else now_s)

    def retry_after_s(self, num_waiting: int) -> int:
        """Seconds until `num_waiting` requests should have left the queue at the recent finish rate."""
        times = self._finish_times_s
        if len(times) < 2 or times[-1] <= times[0]:
            return DEFAULT_RETRY_AFTER_S
        rate_per_s = (len(times) - 1) / (times[-1] - times[0])
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(num_waiting / rate_per_s)))

    def check(self, waiting: Sequence, required_blocks: Mapping[str, int]) -> None:
        """Raise `QueueFullError` if queueing a request that will reserve `required_blocks` would pass a
        bound, given the waiting requests (each with its `admission.required_blocks`). Unbounded, it
        reads nothing: an offline batch queues every prompt at once."""
        if self.max_waiting_requests is None and self.max_waiting_blocks is None:
            return
        message = setting = None
        if self.max_waiting_requests is not None and len(waiting) >= self.max_waiting_requests:
            setting = "max_waiting_requests"
            message = (f"the waiting queue is full: {len(waiting)} requests wait "
                       f"(max_waiting_requests={self.max_waiting_requests})")
        elif self.max_waiting_blocks is not None:
            for pool, blocks in required_blocks.items():
                queued = sum(r.admission.required_blocks.get(pool, 0) for r in waiting)
                if queued and queued + blocks > self.max_waiting_blocks:
                    setting = "max_waiting_blocks"
                    message = (f"the waiting queue is full: its requests will reserve {queued} blocks of "
                               f"pool {pool!r} and this one {blocks} "
                               f"(max_waiting_blocks={self.max_waiting_blocks})")
                    break
        if message is None:
            return
        self.num_refused += 1
        retry_after_s = self.retry_after_s(len(waiting))
        raise QueueFullError(f"{message}; retry in {retry_after_s} s", retry_after_s, setting)
