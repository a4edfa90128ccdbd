"""The ranking server end to end: in-process (httpx ASGI client + lifespan) and over real uvicorn."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn

from hstu import __version__
from hstu.model.config import HSTUConfig
from hstu.model.identity import model_identity
from hstu.serving.app import create_app
from hstu.serving.runtime import ServingRuntime

from .conftest import (
    TASKS,
    TINY,
    Timeline,
    eviction_workload,
    matches_reference,
    post_per_user_in_order,
    response_scores,
    serving,
    tiny_settings,
    wait_ready,
)

anyio = pytest.mark.anyio


def assert_manager_closed(app) -> None:
    with pytest.raises(RuntimeError, match="closed"):
        app.state.runtime.manager.plan([1], [4], [], [1])


@anyio
async def test_scores_equal_the_in_process_no_cache_model_and_reuse_the_cache(reference):
    user = Timeline(7)
    async with serving() as (_, client):
        for step, events in enumerate((3, 10, 10, 31, 60)):
            payload = user.payload(events, num_candidates=4 + step, request_id=f"r{step}")
            r = await client.post("/v1/rank", json=payload)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["request_id"] == f"r{step}" and body["user_id"] == 7
            assert [c["item_id"] for c in body["scores"]] == payload["candidates"]
            assert all(set(c["scores"]) == set(TASKS) for c in body["scores"])
            assert matches_reference(reference, payload, body), f"step {step}"
            tokens = TINY.history_tokens(events)
            assert body["cached_tokens"] + body["computed_tokens"] == tokens + len(payload["candidates"])
            assert body["latency_ms"] > 0
            if step > 0:
                assert body["cached_tokens"] > 0, f"step {step} should reuse the cached history"
        changed = user.payload(61)
        changed["history"][5]["item_id"] = (changed["history"][5]["item_id"] + 1) % TINY.num_items
        r = await client.post("/v1/rank", json=changed)
        assert r.status_code == 200 and matches_reference(reference, changed, r.json())
        assert r.json()["cached_tokens"] == 0, "an edited past event invalidates the cache: recomputed"
        explicit = user.payload(61, contextual=[4, 49])
        r = await client.post("/v1/rank", json=explicit)
        assert r.status_code == 200 and matches_reference(reference, explicit, r.json())
        assert r.json()["cached_tokens"] == 0, "new contextual features change the history: recomputed"
        generated = (await client.post("/v1/rank", json=user.payload(62, contextual=[4, 49]))).json()
        assert len(generated["request_id"]) == 32


@anyio
@pytest.mark.parametrize("host_format", ["kv", "hidden"])
async def test_200_concurrent_requests_from_20_users_with_eviction_match_the_no_cache_model(reference, host_format):
    settings, payloads = eviction_workload(first_user=100, host_format=host_format)
    async with serving(settings) as (app, client):
        responses = await post_per_user_in_order(client, payloads, concurrency=20)
        stats = app.state.runtime.manager.stats.snapshot()
    bodies = [r.json() for r in responses]
    assert [r.status_code for r in responses] == [200] * 200, [b for b in bodies if "error" in b][:3]
    mismatches = [i for i, (p, b) in enumerate(zip(payloads, bodies)) if not matches_reference(reference, p, b)]
    assert mismatches == []
    assert app.state.metrics.registry.get_sample_value("hstu_batch_splits_total") > 0, "batches over the pool split"
    assert stats["gpu_evictions"] > 0 and stats["host_evictions"] > 0, stats
    assert stats["gpu_hits"] > 0 and stats["host_hits"] > 0 and stats["bytes_onloaded"] > 0, stats
    assert (stats["hidden_chunks_onloaded"] > 0) == (host_format == "hidden"), stats
    assert sum(b["cached_tokens"] for b in bodies) > 0


def without(key: str):
    return lambda p: {k: v for k, v in p.items() if k != key}


def replace(key: str, value):
    return lambda p: {**p, key: value}


def last_event(**changes):
    return lambda p: {**p, "history": p["history"][:-1] + [{**p["history"][-1], **changes}]}


def every_event(**changes):
    return lambda p: {**p, "history": [{**e, **changes} for e in p["history"]]}


def no_timestamp(p: dict) -> dict:
    return {**p, "history": p["history"][:-1] + [{"item_id": 1, "action": 1}]}


# (name, payload -> bad payload (or raw bytes), HTTP status, words the error detail must contain)
BAD_INPUTS = [
    ("missing candidates", without("candidates"), 422, ["candidates", "Field required"]),
    ("missing user_id", without("user_id"), 422, ["user_id", "Field required"]),
    ("missing event field", no_timestamp, 422, ["timestamp", "Field required"]),
    ("empty candidates", replace("candidates", []), 422, ["candidates", "at least 1"]),
    ("negative item id", last_event(item_id=-3), 422, ["item_id", "greater than or equal to 0", "-3"]),
    ("negative candidate", replace("candidates", [1, -1]), 422, ["candidates.1", "-1"]),
    ("huge candidate", replace("candidates", [10**12]), 422, ["candidates.0", "less than 1000", str(10**12)]),
    ("huge action", every_event(action=99), 422, ["action", "less than 4", "99"]),
    ("huge user id", replace("user_id", 2**70), 422, ["user_id"]),
    ("negative user id", replace("user_id", -1), 422, ["user_id", "-1"]),
    ("oversized history", lambda p: {**p, "history": [p["history"][0]] * 127}, 422, ["history", "at most 126"]),
    ("too many candidates", replace("candidates", [1] * 65), 422, ["candidates", "at most 64"]),
    ("string item id", replace("candidates", ["abc"]), 422, ["candidates.0", "valid integer", "abc"]),
    ("numeric string", replace("candidates", ["5"]), 422, ["candidates.0", "'5'"]),
    ("float id", replace("candidates", [1.5]), 422, ["candidates.0", "1.5"]),
    ("bool id", replace("candidates", [True]), 422, ["candidates.0"]),
    ("history not a list", replace("history", "abc"), 422, ["history", "valid array"]),
    ("unknown field", replace("histroy", []), 422, ["histroy", "Extra inputs"]),
    ("wrong contextual count", replace("contextual", [1]), 422, ["contextual", "at least 2"]),
    ("contextual out of range", replace("contextual", [1, 50]), 422, ["contextual.1", "less than 50"]),
    ("decreasing timestamps", last_event(timestamp=0), 422, ["non-decreasing", "event"]),
    ("not json", lambda p: b"{user_id: 1", 400, ["JSON"]),
    ("body is a list", lambda p: [p], 422, ["body", "an object"]),
]


@anyio
async def test_every_bad_input_class_gets_4xx_with_a_clear_message_and_leaves_the_cache_consistent(reference):
    user = Timeline(21)
    events = 8
    async with serving() as (app, client):
        r = await client.post("/v1/rank", json=user.payload(events))
        assert r.status_code == 200
        for name, mutate, status, words in BAD_INPUTS:
            bad = mutate(copy.deepcopy(user.payload(events)))
            if isinstance(bad, bytes):
                r = await client.post("/v1/rank", content=bad, headers={"content-type": "application/json"})
            else:
                r = await client.post("/v1/rank", json=bad)
            assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
            body = r.json()
            assert body["error"] in ("invalid_json", "invalid_request", "history_conflict"), name
            for word in words:
                assert word in body["detail"], f"{name}: {word!r} not in {body['detail']!r}"
            events += 2
            good = user.payload(events)
            r = await client.post("/v1/rank", json=good)
            assert r.status_code == 200, f"after {name}: {r.text}"
            assert matches_reference(reference, good, r.json()), f"after {name}"
            assert r.json()["cached_tokens"] > 0, f"after {name}: the user's cache should still be reused"
        assert app.state.runtime.manager.gpu.pin_count(21) == 0


@anyio
async def test_a_fabricated_longer_history_cannot_lock_the_user_out(reference):
    genuine, forged = Timeline(31), Timeline(31)
    forged.items = [(item + 1) % TINY.num_items for item in forged.items]
    async with serving() as (app, client):
        assert (await client.post("/v1/rank", json=genuine.payload(10))).status_code == 200
        r = await client.post("/v1/rank", json=forged.payload(60))
        assert r.status_code == 200, r.text
        for events in (12, 14):
            payload = genuine.payload(events)
            r = await client.post("/v1/rank", json=payload)
            assert r.status_code == 200, r.text
            assert matches_reference(reference, payload, r.json())
        assert r.json()["cached_tokens"] > 0, "after the recompute the genuine history is cached again"
        metrics = (await client.get("/metrics")).text
    assert 'hstu_cache_invalidations_total{reason="diverged"} 1.0' in metrics, "the forged history replaced it"
    assert 'hstu_cache_invalidations_total{reason="shorter"} 1.0' in metrics, "the genuine one replaced it back"


@anyio
async def test_an_older_request_arriving_after_a_newer_one_is_ranked_from_the_cached_prefix(reference):
    """A user's requests overtaking each other (several connections, parse workers): the older,
    shorter history is answered from the first tokens of the newer entry, which stays cached."""
    user = Timeline(33)
    async with serving() as (_, client):
        for events in (10, 30):
            assert (await client.post("/v1/rank", json=user.payload(events))).status_code == 200
        older = user.payload(12, num_candidates=3)
        r = await client.post("/v1/rank", json=older)
        assert r.status_code == 200 and matches_reference(reference, older, r.json())
        assert r.json()["cached_tokens"] == TINY.history_tokens(12), "the whole shorter history came from the cache"
        nxt = user.payload(31)
        r = await client.post("/v1/rank", json=nxt)
        assert r.status_code == 200 and matches_reference(reference, nxt, r.json())
        assert r.json()["cached_tokens"] == TINY.history_tokens(30), "the longer entry was kept"
        metrics = (await client.get("/metrics")).text
    assert "hstu_cache_shorter_reused_total 1.0" in metrics
    assert 'hstu_cache_invalidations_total{reason="shorter"} 0.0' in metrics


@anyio
async def test_strict_history_mode_answers_409_for_a_shorter_history():
    user = Timeline(32)
    async with serving(tiny_settings(on_shorter_history="raise")) as (_, client):
        assert (await client.post("/v1/rank", json=user.payload(10))).status_code == 200
        r = await client.post("/v1/rank", json=user.payload(4))
        assert r.status_code == 409, r.text
        assert r.json()["error"] == "history_conflict"
        assert all(word in r.json()["detail"] for word in ("shorter", "cached", "full history"))


@anyio
async def test_request_larger_than_the_whole_cache_gets_503_and_others_still_work(reference):
    async with serving(tiny_settings(num_pages=8)) as (_, client):
        big, small = Timeline(1).payload(40), Timeline(2).payload(10)
        r_big, r_small = await asyncio.gather(client.post("/v1/rank", json=big), client.post("/v1/rank", json=small))
        assert r_big.status_code == 503 and r_big.json()["error"] == "capacity", r_big.text
        assert "user 1" in r_big.json()["detail"] and "pages" in r_big.json()["detail"]
        assert r_small.status_code == 200 and matches_reference(reference, small, r_small.json())


@anyio
async def test_failing_model_call_gives_500_and_the_server_keeps_serving(reference, monkeypatch):
    bad_user, good_user = Timeline(666), Timeline(5)
    async with serving() as (app, client):
        model = app.state.runtime.model
        embed = model.preprocessor.embed

        def failing_embed(requests, *args, **kwargs):
            if any(r.user_id == 666 for r in requests):
                raise RuntimeError("injected embedding failure")
            return embed(requests, *args, **kwargs)

        monkeypatch.setattr(model.preprocessor, "embed", failing_embed)
        first_good = good_user.payload(12)
        r_bad, r_good = await asyncio.gather(
            client.post("/v1/rank", json=bad_user.payload(12)), client.post("/v1/rank", json=first_good)
        )
        assert r_bad.status_code == 500, r_bad.text
        assert r_bad.json()["error"] == "internal" and "injected embedding failure" in r_bad.json()["detail"]
        assert r_good.status_code == 200 and matches_reference(reference, first_good, r_good.json())
        assert (await client.get("/v2/health/live")).status_code == 200
        assert (await client.get("/v2/health/ready")).status_code == 200

        monkeypatch.undo()
        retry, more = bad_user.payload(12), good_user.payload(20)
        r_retry = await client.post("/v1/rank", json=retry)
        r_more = await client.post("/v1/rank", json=more)
        assert r_retry.status_code == 200 and matches_reference(reference, retry, r_retry.json())
        assert r_more.status_code == 200 and matches_reference(reference, more, r_more.json())
        assert r_more.json()["cached_tokens"] > 0
        metrics = (await client.get("/metrics")).text
        assert 'hstu_errors_total{kind="internal"} 1.0' in metrics


@anyio
async def test_ready_is_503_until_warm_up_finishes_while_live_answers(monkeypatch, reference):
    release = threading.Event()
    warm_up = ServingRuntime._warm_up

    def slow_warm_up(self):
        release.wait(30)
        warm_up(self)

    monkeypatch.setattr(ServingRuntime, "_warm_up", slow_warm_up)
    async with serving(ready=False) as (_, client):
        assert (await client.get("/v2/health/live")).status_code == 200
        r = await client.get("/v2/health/ready")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        payload = Timeline(3).payload(5)
        r = await client.post("/v1/rank", json=payload)
        assert r.status_code == 503 and r.json()["error"] == "unavailable"
        release.set()
        await wait_ready(client)
        r = await client.post("/v1/rank", json=payload)
        assert r.status_code == 200 and matches_reference(reference, payload, r.json())


@anyio
async def test_failed_load_reports_not_live_and_not_ready_without_leaking_the_cause(tmp_path, caplog):
    async with serving(tiny_settings(checkpoint=str(tmp_path / "missing.pt")), ready=False) as (app, client):
        for _ in range(500):
            if app.state.runtime.state != "loading":
                break
            await asyncio.sleep(0.01)
        live, ready = await client.get("/v2/health/live"), await client.get("/v2/health/ready")
        model_ready = await client.get("/v2/models/hstu/ready")
    assert live.status_code == ready.status_code == model_ready.status_code == 503
    for r in (live, ready, model_ready):
        assert r.json()["error"] == "unavailable" and "loading the model failed" in r.json()["detail"]
        assert "missing.pt" not in r.text and str(tmp_path) not in r.text and "Error" not in r.text
    assert "missing.pt" in caplog.text, "the cause goes to the log"


@anyio
async def test_shutdown_drains_in_flight_requests_then_closes_the_cache(reference):
    users = [Timeline(300 + u) for u in range(12)]
    payloads = [u.payload(30) for u in users]
    app = create_app(tiny_settings(max_batch_size=4))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        async with app.router.lifespan_context(app):
            await wait_ready(client)
            tasks = [asyncio.create_task(client.post("/v1/rank", json=p)) for p in payloads]
            for _ in range(10_000):
                if app.state.runtime.batcher.pending == len(payloads):
                    break
                await asyncio.sleep(0.001)
            assert app.state.runtime.batcher.pending == len(payloads), "requests did not reach the batcher"
        assert_manager_closed(app)
        responses = [await t for t in tasks]
        assert [r.status_code for r in responses] == [200] * len(payloads)
        assert all(matches_reference(reference, p, r.json()) for p, r in zip(payloads, responses))
        r = await client.post("/v1/rank", json=payloads[0])
        assert r.status_code == 503 and r.json()["error"] == "unavailable"


@anyio
async def test_metrics_expose_latency_batch_size_cache_tiers_bytes_evictions_and_errors():
    async with serving(tiny_settings(num_pages=16)) as (_, client):
        for u in range(6):
            await client.post("/v1/rank", json=Timeline(u).payload(20))
        await client.post("/v1/rank", json={"user_id": 1})
        text = (await client.get("/metrics")).text
    for series in (
        'hstu_request_latency_seconds_count{status="200"} 6.0',
        'hstu_request_phase_seconds_count{phase="read_parse"} 6.0',  # answered requests only
        'hstu_request_phase_seconds_count{phase="rank"} 6.0',
        'hstu_request_phase_seconds_count{phase="respond"} 6.0',
        "hstu_batch_size_count",
        'hstu_cache_hit_rate{tier="gpu"}',
        'hstu_cache_hit_rate{tier="host"}',
        'hstu_cache_lookups_total{result="miss"}',
        'hstu_cache_bytes_total{direction="offload"}',
        'hstu_cache_bytes_total{direction="onload"}',
        'hstu_cache_evictions_total{tier="gpu"}',
        "hstu_cache_recomputes_total",
        'hstu_errors_total{kind="invalid_request"} 1.0',
        "hstu_ready 1.0",
    ):
        assert series in text, series
    evictions = next(line for line in text.splitlines() if line.startswith('hstu_cache_evictions_total{tier="gpu"}'))
    assert float(evictions.split()[-1]) > 0


@anyio
async def test_openapi_docs_describe_the_rank_endpoint_with_the_model_limits():
    async with serving() as (_, client):
        assert (await client.get("/docs")).status_code == 200
        spec = (await client.get("/openapi.json")).json()
    assert {"/v1/rank", "/v2/health/live", "/v2/health/ready", "/metrics"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert schemas["RankRequest"]["properties"]["history"]["maxItems"] == 126
    assert schemas["RankRequest"]["properties"]["candidates"]["maxItems"] == 64
    assert schemas["HistoryEvent"]["properties"]["item_id"]["exclusiveMaximum"] == 1000


@anyio
async def test_docs_page_uses_local_assets_only():
    """/docs works offline: every script and stylesheet it loads is served by this server."""
    async with serving() as (_, client):
        page = (await client.get("/docs")).text
        assets = [(await client.get(f"/docs-assets/{name}")).status_code for name in ("swagger-ui-bundle.js", "swagger-ui.css")]
    assert "/docs-assets/swagger-ui-bundle.js" in page and "/docs-assets/swagger-ui.css" in page
    assert "cdn." not in page and "https://" not in page.split("<body>")[0], page[:400]
    assert assets == [200, 200]


@anyio
async def test_openapi_examples_are_requests_that_rank(reference):
    """The docs' "Try it out" sends the schema's example: both forms must rank, with equal scores."""
    async with serving() as (_, client):
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
        bodies = [schemas[name]["examples"][0] for name in ("RankRequest", "RankRequestColumns")]
        answers = [await client.post("/v1/rank", json=body) for body in bodies]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    # One user and history: the second answer re-ranks over the first's cached K/V, so the two
    # agree to the fp32 oracle's tolerance, not bit for bit (other matmul shapes).
    np.testing.assert_allclose(response_scores(answers[1].json()), response_scores(answers[0].json()), rtol=1e-5, atol=1e-6)
    assert set(schemas["RankResponse"]["examples"][0]) == set(answers[0].json())


async def post_concurrently(base_url: str, payloads: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return await post_per_user_in_order(client, payloads, concurrency=8)


def test_real_uvicorn_server_on_loopback_serves_scores_and_stops(reference):
    app = create_app(tiny_settings())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=30) as client:
            while client.get("/v2/health/ready").status_code != 200:
                assert time.monotonic() < deadline, "server not ready"
                time.sleep(0.01)
            payload = Timeline(11).payload(15)
            r = client.post("/v1/rank", json=payload)
            assert r.status_code == 200 and matches_reference(reference, payload, r.json())
        payloads = [Timeline(400 + u).payload(5 + 4 * k) for k in range(3) for u in range(8)]
        responses = asyncio.run(post_concurrently(base, payloads))
        assert [r.status_code for r in responses] == [200] * len(payloads)
        assert all(matches_reference(reference, p, r.json()) for p, r in zip(payloads, responses))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive(), "uvicorn did not stop"
    assert_manager_closed(app)


@anyio
async def test_model_metadata_names_the_config_limits_cache_and_the_weights_fingerprint(reference):
    async with serving() as (_, client):
        meta = (await client.get("/v2/models/hstu")).json()
        alias = (await client.get("/v1/model")).json()
        ready = await client.get("/v2/models/hstu/ready")
    assert meta == alias
    assert (meta["name"], meta["platform"], meta["versions"]) == ("hstu", "pytorch", [__version__])
    assert meta["package_version"] == __version__ and meta["ready"] is True
    assert HSTUConfig(**meta["config"]) == TINY and meta["task_names"] == list(TASKS)
    assert meta["limits"]["max_events"] == 126 and meta["limits"]["max_candidates"] == 64
    assert meta["limits"]["max_body_bytes"] > 126 * 100
    assert (meta["dtype"], meta["device"]) == ("float32", "cpu")
    assert meta["cache"] == {"page_size": 8, "num_pages": 64, "chunk_tokens": 16, "host_cache_bytes": 1 << 20, "host_format": "kv"}
    assert meta["weights_fingerprint"] == model_identity(reference, TINY).hex()
    assert ready.status_code == 200 and ready.json() == {"name": "hstu", "ready": True}


@anyio
async def test_model_metadata_before_the_model_is_loaded_has_no_fingerprint_and_is_not_ready(tmp_path):
    async with serving(tiny_settings(checkpoint=str(tmp_path / "missing.pt")), ready=False) as (app, client):
        meta = (await client.get("/v2/models/hstu")).json()
    assert meta["weights_fingerprint"] is None and meta["ready"] is False


@anyio
async def test_prefetch_over_http_puts_a_host_tier_user_back_on_the_gpu(reference):
    user = Timeline(41)
    async with serving(tiny_settings(planner=True, planner_min_gain=0.25, planner_compute_margin=0.2)) as (app, client):
        for events in (20, 24):  # seen twice: its chunks are admitted to the host tier
            assert (await client.post("/v1/rank", json=user.payload(events))).status_code == 200
        manager = app.state.runtime.manager
        manager.evict_gpu([41])
        r = await client.post("/v1/prefetch", json={"user_ids": [41, 41, 999]})
        assert r.status_code == 200 and r.json() == {"requested": 2, "started": 1}, r.text
        payload = user.payload(26)
        r = await client.post("/v1/rank", json=payload)
        assert r.status_code == 200 and r.json()["cached_tokens"] == 48 and matches_reference(reference, payload, r.json())
        bad = await client.post("/v1/prefetch", json={"user_ids": []})
        assert bad.status_code == 422 and bad.json()["error"] == "invalid_request"
        metrics = (await client.get("/metrics")).text
    assert 'hstu_cache_prefetch_total{result="hit"} 1.0' in metrics
    assert 'hstu_planner_cost{input="h2d_bytes_per_s"}' in metrics
    assert 'hstu_planner_cost{input="min_gain"} 0.25' in metrics, "the override reaches the planner"
    assert 'hstu_planner_cost{input="compute_margin"} 0.2' in metrics


@anyio
async def test_a_planned_host_tier_batch_is_counted_and_its_measured_factor_exported(reference):
    user = Timeline(43)
    async with serving(tiny_settings(planner=True)) as (app, client):
        for events in (20, 24):  # seen twice: its chunks are admitted to the host tier
            assert (await client.post("/v1/rank", json=user.payload(events))).status_code == 200
        app.state.runtime.manager.evict_gpu([43])
        payload = user.payload(26)
        r = await client.post("/v1/rank", json=payload)
        assert r.status_code == 200 and matches_reference(reference, payload, r.json())
        metrics = (await client.get("/metrics")).text
    plans = {kind: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             for kind in ("split", "onload", "recompute") if line.startswith(f'hstu_planner_plans_total{{kind="{kind}"}}')}
    assert sum(plans.values()) == 1.0, plans
    assert 'hstu_planner_plans_total{kind="overridden"} 0.0' in metrics
    kind = next(k for k, v in plans.items() if v)
    assert f'hstu_planner_feedback{{kind="{kind}",users="1"}}' in metrics


@anyio
async def test_rank_goes_straight_to_its_handler_and_a_bug_there_is_a_500_in_the_error_shape(reference, monkeypatch):
    """RankingApp: POST /v1/rank skips the middleware stack and router (the route stays for OpenAPI
    and 405s); an exception the handler does not answer is a counted 500 in the one error shape."""
    from fastapi import FastAPI

    import hstu.serving.app as app_module
    from .conftest import assert_error_shape

    routed = []
    router_call = FastAPI.__call__

    async def spy(self, scope, receive, send):
        routed.append(scope.get("path"))
        await router_call(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", spy)
    async with serving() as (app, client):
        payload = Timeline(3).payload(8)
        r = await client.post("/v1/rank", json=payload)
        assert r.status_code == 200 and matches_reference(reference, payload, r.json())
        assert "/v1/rank" not in routed, "the rank handler ran without FastAPI's stack"
        assert_error_shape(await client.get("/v1/rank"), 405, "method_not_allowed")
        assert "/v1/rank" in (await client.get("/openapi.json")).json()["paths"]

        def broken(doc):
            raise KeyError("injected encoding bug")

        monkeypatch.setattr(app_module, "encode_response", broken)
        body = assert_error_shape(await client.post("/v1/rank", json=Timeline(4).payload(8)), 500, "internal")
        assert "KeyError" in body["detail"]
        assert 'hstu_errors_total{kind="internal"} 1.0' in (await client.get("/metrics")).text
        monkeypatch.undo()
        again = Timeline(4).payload(9)
        r = await client.post("/v1/rank", json=again)
        assert r.status_code == 200 and matches_reference(reference, again, r.json())


@anyio
async def test_rank_takes_the_stack_once_middleware_is_added(reference):
    """A middleware added to the app (authentication, CORS) sees POST /v1/rank too."""
    seen = []

    async with serving(ready=False) as (app, client):  # no request yet: middleware may still be added
        @app.middleware("http")
        async def note(request, call_next):
            seen.append(request.url.path)
            return await call_next(request)

        await wait_ready(client)
        seen.clear()
        payload = Timeline(8).payload(6)
        r = await client.post("/v1/rank", json=payload)
        assert r.status_code == 200 and matches_reference(reference, payload, r.json())
        assert seen == ["/v1/rank"]


def test_generated_request_ids_are_unique_per_process_and_after_a_fork():
    from hstu.serving.app import RequestIds

    ids = RequestIds()
    first = [ids() for _ in range(1000)]
    assert len(set(first)) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in first)
    assert RequestIds()() != RequestIds()(), "each process (and each app) draws its own random prefix"
    ids._restart()  # what a forked child runs (os.register_at_fork): a new prefix, the counter from 0
    assert not set(first) & {ids() for _ in range(1000)}


@anyio
async def test_a_requests_batch_window_counts_from_its_arrival_at_the_http_handler(reference, monkeypatch):
    """The handler hands the runtime the request's arrival (time.monotonic() at its first line): the
    batch window, queue limit and deadline count from there, whatever parsing and pipes took."""
    from hstu.serving.batcher import Batcher

    seen = []
    submit = Batcher.submit

    async def spy(self, request, deadline=float("inf"), arrived=None, answer=None):
        seen.append((time.monotonic(), deadline, arrived))
        return await submit(self, request, deadline, arrived, answer)

    monkeypatch.setattr(Batcher, "submit", spy)
    settings = tiny_settings()
    async with serving(settings) as (_, client):
        before = time.monotonic()
        payload = Timeline(9).payload(7)
        r = await client.post("/v1/rank", json=payload)
        assert r.status_code == 200 and matches_reference(reference, payload, r.json())
    (queued, deadline, arrived), = seen
    assert before <= arrived <= queued
    assert deadline - arrived == pytest.approx(settings.request_timeout_ms / 1000.0)
