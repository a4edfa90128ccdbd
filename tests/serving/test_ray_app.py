"""The Ray Serve application on a local Ray cluster (loopback, CPU, the tiny model): cache affinity
by user, correctness against the no-cache model, a replica lost mid-run, scaling out.

One Ray cluster and one Serve instance for the whole module (starting Ray costs ~10 s); each test
deploys the app with the replica count it needs (a lightweight update when only that changes) and
uses its own users, so the replicas' caches never mix two tests' histories.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")  # a dependency of ray

from ray.serve.context import _get_global_client  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from hstu.scripts.loadtest import wait_until_ready  # noqa: E402
from hstu.serving.ray_app import INGRESS, RANKING  # noqa: E402
from hstu.serving.settings import ServerSettings  # noqa: E402
from hstu.serving.user_ring import UserRing  # noqa: E402
from tests.serving.conftest import (  # noqa: E402
    Timeline,
    free_port,
    matches_reference,
    post_per_user_in_order,
    tiny_settings,
)
from tests.serving.test_incremental import as_events, full_columns, increment  # noqa: E402

USERS = 20
ROUNDS = 10
# Room for every user: a miss means a moved user. The deadline is far past the default 10 s: on a
# loaded 2-core runner, requests retried after the replica kill took longer (504s seen once at a
# 10 s deadline; at 60 s, two client read timeouts in three full CI runs of session 11, while the
# test alone passed in 18 s): Serve takes that long to drop the dead replica there. What the
# tests assert is that no request is lost or wrong, not how fast a starved cluster fails over.
# At 150 s one request still passed its deadline in a fresh-clone CI run (2026-12-06, twice in
# sessions 38-39) while Serve logged the two live replicas missing queue-length probes for ~80 s:
# its calls, each taken as lost after a third of the deadline (50 s) and sent again, all fell in
# that stretch. At 300 s a call waits 100 s before it is retried.
SETTINGS = tiny_settings(num_pages=512, max_batch_size=4, request_timeout_ms=300_000.0)
CLIENT_TIMEOUT_S = 330.0  # past the deadline: a late answer is the server's 504, not the client giving up
SERVE_CONFIG = Path(__file__).parents[2] / "deploy" / "ray-serve.yaml"


# Serve's router asks a replica its queue length before sending it a request, within 0.1 s doubling
# up to 1 s, and retries for as long as no replica answers. On a 2-core CI machine a replica busy
# recomputing the users of a killed one missed every probe for over a minute (fresh-clone CI,
# 2026-12-04, twice), so a request waited past its deadline unsent; the workers started below
# inherit these longer probe deadlines.
_PROBE_DEADLINES = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "0.5", "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10"}


@pytest.fixture(scope="module")
def cluster() -> str:
    """The Serve proxy's base URL on a local Ray cluster of 4 logical CPUs."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in _PROBE_DEADLINES.items():
            env.setenv(name, value)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()


def serve_config(url: str, replicas: int) -> ServeDeploySchema:
    """deploy/ray-serve.yaml on loopback and CPU, with the tiny model and `replicas` replicas."""
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    (app,) = config["applications"]
    defaults = ServerSettings()
    settings = {
        f.name: getattr(SETTINGS, f.name)
        for f in dataclasses.fields(ServerSettings)
        if f.name != "model_config" and getattr(SETTINGS, f.name) != getattr(defaults, f.name)
    }
    app["args"] = {**app["args"], "gpus_per_replica": 0, "cpus_per_replica": 0.5,
                   "settings": {**settings, "model": SETTINGS.model_config.to_dict()}}
    app["deployments"] = [{"name": RANKING, "num_replicas": replicas}, {"name": INGRESS, "num_replicas": 1}]
    host, port = url.removeprefix("http://").split(":")
    return ServeDeploySchema(**{**config, "http_options": {"host": host, "port": int(port)}, "proxy_location": "HeadOnly"})


def deploy(url: str, replicas: int) -> None:
    """The config-file app with `replicas` ranking replicas (as `serve deploy` applies it: a change
    of num_replicas alone keeps the running replicas), ready, with the ingress seeing all of them."""
    _get_global_client().deploy_apps(serve_config(url, replicas), _blocking=True)
    wait_until_ready(url, lambda: True, timeout_s=60)
    deadline = time.monotonic() + 30
    while len(replica_names(url)) != replicas or httpx.get(f"{url}/v2/models/hstu").json()["replicas"] != replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ingress did not see {replicas} replicas: {replica_names(url)}")
        time.sleep(0.2)


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def replica_names(url: str) -> set[str]:
    """The replicas whose metrics the ingress merged into /metrics (each one's hstu_ready sample)."""
    return set(re.findall(r'^hstu_ready\{replica="([^"]+)"\} 1\.0$', scrape(url), re.M))


def sample(text: str, name: str) -> float:
    """The value of one unlabelled (or fully spelled-out) sample in a Prometheus text."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def rounds(first_user: int, users: int, steps: int) -> list[list[dict]]:
    """steps rounds of one request per user; each request extends the user's previous history."""
    timelines = [Timeline(first_user + u) for u in range(users)]
    return [[t.payload(6 + 3 * step, num_candidates=3) for t in timelines] for step in range(steps)]


async def post_all(url: str, payloads: list[dict], concurrency: int = 8) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        return await post_per_user_in_order(client, payloads, concurrency)


def assert_all_match(reference, payloads: list[dict], responses: list[httpx.Response]) -> None:
    assert [r.status_code for r in responses] == [200] * len(payloads), [r.text for r in responses if r.status_code != 200]
    wrong = [p["user_id"] for p, r in zip(payloads, responses) if not matches_reference(reference, p, r.json())]
    assert not wrong, f"results differ from the no-cache model for users {wrong}"


def test_two_replicas_keep_each_user_on_its_cache_and_match_the_no_cache_model(cluster, reference):
    deploy(cluster, 2)
    payloads = [p for step in rounds(10_000, USERS, ROUNDS) for p in step]
    responses = asyncio.run(post_all(cluster, payloads))
    assert_all_match(reference, payloads, responses)
    repeats = [r.json()["cached_tokens"] > 0 for r in responses[USERS:]]  # every user's 2nd..10th request
    assert sum(repeats) >= 0.95 * len(repeats), f"{sum(repeats)} of {len(repeats)} repeat requests hit the cache"
    metrics = scrape(cluster)
    assert sample(metrics, 'hstu_router_decisions_total{decision="affinity"}') >= 0.95 * len(payloads)
    # the ingress's calls carried every request, each at most once (coalesced calls count every user)
    assert sample(metrics, "hstu_replica_call_requests_total") == len(payloads)
    assert 0 < sample(metrics, "hstu_replica_calls_total") <= len(payloads)
    per_replica = re.findall(r'^hstu_cache_lookups_total\{replica="[^"]+",result="miss"\} (\S+)$', metrics, re.M)
    assert len(per_replica) == 2 and all(float(v) > 0 for v in per_replica), "both replicas own users"
    assert httpx.get(f"{cluster}/v2/models/hstu").json()["replicas"] == 2
    prefetch = httpx.post(f"{cluster}/v1/prefetch", json={"user_ids": [10_000, 10_001]}, timeout=30)
    assert prefetch.status_code == 200 and prefetch.json()["requested"] == 2, prefetch.text


def serve_log_excerpt(max_lines: int = 200) -> str:
    """The WARNING and ERROR lines of this Ray session's Serve logs (controller, proxy, replicas)
    and workers' stderr (our own loggers), which log_to_driver=False keeps out of pytest's
    capture: why a failover stalled, if it did."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    lines = [
        f"{path.name}: {line}"
        for path in sorted((logs / "serve").glob("*.log")) + sorted(logs.glob("worker-*.err"))
        for line in path.read_text(errors="replace").splitlines()
        if re.search(r"\b(WARNING|ERROR)\b", line)
    ]
    return "\n".join(lines[-max_lines:])


def test_a_replica_killed_mid_run_loses_no_request_and_its_users_rehome(cluster, reference):
    deploy(cluster, 2)
    steps = rounds(20_000, USERS, ROUNDS)
    victim = sorted(replica_names(cluster))[0]
    moved_before = sample(scrape(cluster), "hstu_router_moved_users_total")

    async def run() -> list[httpx.Response]:
        responses = []
        async with httpx.AsyncClient(base_url=cluster, timeout=CLIENT_TIMEOUT_S) as client:
            for k, step in enumerate(steps):
                sending = [asyncio.create_task(client.post("/v1/rank", json=p)) for p in step]
                if k == 3:  # once the first answer is back, the rest are queued on both replicas
                    await asyncio.wait(sending, return_when=asyncio.FIRST_COMPLETED)
                    ray.kill(_replica_actor(victim), no_restart=True)
                responses += await asyncio.gather(*sending)
        return responses

    responses = asyncio.run(run())
    try:
        assert_all_match(reference, [p for step in steps for p in step], responses)
    except AssertionError as exc:  # the flake seen in CI (issue 16): say what Serve logged meanwhile
        raise AssertionError(f"{exc}\n--- Serve's warnings and errors ---\n{serve_log_excerpt()}") from None
    after = scrape(cluster)
    assert sample(after, "hstu_router_moved_users_total") > moved_before, "the lost replica's users moved"
    assert victim not in replica_names(cluster)


def _replica_actor(name: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#{RANKING}#{name}"):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise LookupError(f"no actor for ranking replica {name}")


def test_scaling_two_to_three_replicas_moves_only_the_new_replicas_users(cluster, reference):
    """The users who recompute after scaling out are exactly those the ring hands to the new
    replica: about a third (the bound allows the spread of random replica names and 200 users)."""
    deploy(cluster, 2)
    users = 200
    first, second = rounds(30_000, users, 2)
    assert_all_match(reference, first, asyncio.run(post_all(cluster, first)))
    before = replica_names(cluster)
    deploy(cluster, 3)
    after = replica_names(cluster)
    assert before < after, "scaling out kept the two replicas and their caches"
    responses = asyncio.run(post_all(cluster, second))
    assert_all_match(reference, second, responses)
    moved = {p["user_id"] for p, r in zip(second, responses) if r.json()["cached_tokens"] == 0}
    old, new = UserRing(before), UserRing(after)
    expected = {p["user_id"] for p in second if old.owner(p["user_id"]) != new.owner(p["user_id"])}
    assert moved == expected
    assert {new.owner(u) for u in moved} == after - before
    # Replica names are random, so is the new replica's arc: over 300 simulated name sets the moved
    # share had mean 0.33, 99th percentile 0.43 and max 0.475 (0.45 failed once here).
    assert 0 < len(moved) <= 0.5 * users, f"{len(moved)} of {users} users moved to another replica"


def test_incremental_requests_are_rebuilt_at_the_ingress_and_hit_the_users_replica(cluster, reference):
    deploy(cluster, 2)
    timeline = Timeline(40_000)
    with httpx.Client(base_url=cluster, timeout=30) as client:
        previous = client.post("/v1/rank", json=full_columns(timeline, 10, [1, 2, 3])).json()
        for events in (11, 30, 60):
            response = client.post("/v1/rank", json=increment(timeline, previous, events, [4, 5]))
            assert response.status_code == 200, response.text
            previous = response.json()
            assert matches_reference(reference, as_events(full_columns(timeline, events, [4, 5])), previous)
            assert previous["cached_tokens"] > 0 and previous["history_length"] == events


def test_a_call_given_up_on_is_cancelled_at_serve_too():
    """The coalescer gives up on a silent call by cancelling the task awaiting it; the Serve call
    must be cancelled with it, or a merely slow call and its retry both run."""
    from hstu.serving.ray_app import await_or_cancel

    class SlowResponse:
        def __init__(self) -> None:
            self.cancelled = False
            self._never = asyncio.get_running_loop().create_future()

        def __await__(self):
            return self._never.__await__()

        def cancel(self) -> None:
            self.cancelled = True

    async def scenario() -> tuple[bool, bool]:
        slow = SlowResponse()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(await_or_cancel(slow), 0.01)
        fast = SlowResponse()
        fast._never.set_result("answer")
        assert await await_or_cancel(fast) == "answer"
        return slow.cancelled, fast.cancelled

    assert asyncio.run(scenario()) == (True, False)
