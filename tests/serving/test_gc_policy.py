"""A serving process freezes its startup objects out of the collector's scans (serving/gc_policy.py)."""

from __future__ import annotations

import gc

from hstu.serving.gc_policy import freeze_startup_objects


def test_startup_objects_are_frozen_and_the_knob_leaves_the_collector_alone(monkeypatch):
    try:
        kept = [[i] for i in range(1000)]  # containers alive at "startup"
        assert freeze_startup_objects("test") >= len(kept) and gc.get_freeze_count() >= len(kept)
        gc.unfreeze()
        monkeypatch.setenv("HSTU_GC_FREEZE", "0")
        assert freeze_startup_objects("test") == 0 and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_ready_runtime_has_frozen_its_startup_objects():
    import asyncio

    from tests.serving.conftest import tiny_settings
    from hstu.serving.runtime import ServingRuntime

    async def run():
        runtime = ServingRuntime.standalone(tiny_settings())
        try:
            await runtime.start()
            assert runtime.state == "ready" and gc.get_freeze_count() > 0
        finally:
            await runtime.close()

    try:
        gc.unfreeze()
        asyncio.run(run())
    finally:
        gc.unfreeze()
