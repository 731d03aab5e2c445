"""Long-lived processes freeze what start-up allocated, so the cyclic collector never walks it again.

An engine's start-up leaves some 360,000 objects the collector tracks (the model's modules and
parameters, the tokenizer, transformers', torch's and pydantic's own tables, the catalogues), and none
of them will ever be garbage. Python's full collection walks every tracked object; it runs when enough
objects have survived the younger generations, which a wide request makes happen mid-step: the
collection then lands inside one decode step and makes it the slowest of the request. Frozen objects
(`gc.freeze`) move to a permanent generation no collection visits, so a full collection walks only
what requests allocated. The cost: a frozen object that later becomes cyclic garbage is never
reclaimed, which is why only start-up's objects are frozen, once, after a collection.

`serve`, `batch`, `generate` and `bench` call `freeze_startup_heap` once their engine is built; a
library user's process is left as it is (`LLM(...)` does not touch the collector).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("widebeam")


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze every object still tracked. Returns the
    number of objects now frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the collector's reach", frozen)
    return frozen
