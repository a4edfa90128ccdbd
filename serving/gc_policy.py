"""Python's cyclic garbage collector against a serving process's latency.

A full (generation 2) collection walks every container object the process tracks and holds the
GIL meanwhile, so it stops every thread: the model thread, the event loop, the pipe readers.
After the imports alone (torch, the model, FastAPI) a process tracks ~200k objects, and a full
collection of them took 66-119 ms on the dev CPU; a 400-request CPU replay ran 4 of them, one
inside a timed pass (114 ms; 17 ms with the startup objects frozen). They come as requests'
short-lived objects survive into the older generations, and each is a tail latency for every
request in flight (run CM's paced REST load: p99 165 ms).

freeze_startup_objects(), called once a process is ready to serve (an engine's runtime after its
warm-up, a front end, a parse worker once its parser is built, a replay pass after its warm-up),
collects once and moves every object alive then into the permanent generation (gc.freeze), which
later collections skip: they walk only what serving itself creates. HSTU_GC_FREEZE=0 leaves the
collector as Python sets it (an experiment knob, for a same-call comparison).
"""

from __future__ import annotations

import gc
import logging
import os
import time

logger = logging.getLogger(__name__)


def freeze_startup_objects(where: str) -> int:
    """Collect, then freeze every object alive now; the number frozen (0 when disabled)."""
    if os.environ.get("HSTU_GC_FREEZE", "1") == "0":
        return 0
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d startup objects frozen out of the garbage collector's scans (%.0f ms)",
                where, frozen, (time.perf_counter() - started) * 1e3)
    return frozen
