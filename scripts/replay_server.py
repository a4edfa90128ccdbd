"""Server mode of `hstu replay`: the workload over HTTP to a running `hstu serve` on loopback,
`concurrency` requests in flight and each user's requests in order; the server's cache counters
from its /metrics (read through serving/metrics.py's own counter table); --verify of the answers
against a local no-cache model whose weights fingerprint equals the server's."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import urlparse

import torch
from tqdm import tqdm

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.identity import model_identity
from hstu.model.ranking import InferenceRankingGR
from hstu.scripts.compare import VerifyTally
from hstu.scripts.replay_passes import PassResult, RequestRecord

logger = logging.getLogger(__name__)


def check_loopback(url: str) -> None:
    """Raise ValueError unless `url` is http(s) on a loopback host."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--server must be an http URL on a loopback host (127.0.0.1, localhost, ::1), got {url!r}")


# (metric sample name, label value or None) -> CacheStats key, as exported by hstu.serving.metrics;
# samples mapped to one key are summed.


_FOLDED_STATS = {"invalidated_shorter": "invalidations", "invalidated_diverged": "invalidations"}
"""Stats keys the replay reports summed under one key (both invalidation reasons)."""

_BATCH_SAMPLES = {("hstu_batch_size_count", None): "batches", ("hstu_batch_size_sum", None): "batched_requests"}


def server_metric_keys() -> dict[tuple[str, str | None], str]:
    """(sample name, label value or None) -> the replay's stats key; samples mapped to one key are summed."""
    from hstu.serving.metrics import cache_counter_samples

    keys = {sample: _FOLDED_STATS.get(key, key) for sample, key in cache_counter_samples().items()}
    return {**keys, **_BATCH_SAMPLES}


def parse_server_metrics(text: str) -> dict[str, int]:
    """Cache counters and batch counts from the server's Prometheus /metrics text, summed over
    its replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    from hstu.serving.metrics import REPLICA_LABEL

    keys = server_metric_keys()
    stats: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # a replica's samples (`--engine-process`, Ray Serve) also carry replica=<name>; the
            # counter's own label is the other one, and replicas' samples are summed
            label = next((v for k, v in sample.labels.items() if k != REPLICA_LABEL), None)
            key = keys.get((sample.name, label))
            if key is not None:
                stats[key] = stats.get(key, 0) + int(sample.value)
    return stats


async def _scrape(client, url: str) -> dict[str, int]:
    import httpx

    from hstu.client import HSTUClientError

    try:
        text = await client.metrics()
    except (httpx.HTTPError, HSTUClientError) as exc:
        logger.warning("could not read %s/metrics (%s); cache counters are left out", url, exc)
        return {}
    return parse_server_metrics(text)


async def _send_all(
    url: str,
    requests: list[RankingRequest],
    model_config: HSTUConfig,
    concurrency: int,
    timeout_s: float,
    progress: bool,
    answers: list | None,
    incremental: bool = False,
) -> PassResult:
    import httpx

    from hstu.client import AsyncClient, HSTUClientError, RetryPolicy

    limit = asyncio.Semaphore(concurrency)
    previous: dict[int, asyncio.Task] = {}
    records: list[RequestRecord | None] = [None] * len(requests)
    errors = conflicts = 0
    bar = tqdm(total=len(requests), desc="server", unit="req", disable=not progress, leave=False)

    # A replay measures the server, so it waits out overload (Retry-After) longer than a
    # latency-bound caller would: a slow CPU server's queue must not turn into failed requests.
    async with AsyncClient(url, timeout_s=timeout_s, retry=RetryPolicy(max_attempts=8, max_wait_s=60.0)) as client:

        async def one(index: int, request: RankingRequest, before: asyncio.Task | None) -> None:
            nonlocal errors, conflicts
            if before is not None:
                await asyncio.wait([before])
            async with limit:
                t0 = time.perf_counter()
                try:
                    result = await client.rank(
                        request.user_id,
                        (request.item_ids, request.actions, request.timestamps),
                        request.candidates,
                        contextual=request.contextual,
                        incremental=incremental,
                    )
                except HSTUClientError as exc:
                    if exc.status == 409:
                        conflicts += 1
                        logger.info("request %d (user %d): history conflict: %s", index, request.user_id, exc)
                    else:
                        errors += 1
                        logger.warning("request %d (user %d) failed: %s", index, request.user_id, exc)
                    return
                except (httpx.HTTPError, ValueError) as exc:
                    errors += 1
                    logger.warning("request %d (user %d) failed: %s", index, request.user_id, exc)
                    return
                finally:
                    bar.update(1)
                ms = (time.perf_counter() - t0) * 1e3
            if answers is not None:
                answers.append((request, result))
            records[index] = RequestRecord(
                request.user_id,
                request.history_tokens(model_config),
                request.candidates.shape[0],
                result.cached_tokens,
                index,
                1,
                ms,
            )

        before = await _scrape(client, url)
        t0 = time.perf_counter()
        tasks = []
        for i, r in enumerate(requests):
            task = asyncio.create_task(one(i, r, previous.get(r.user_id)))
            previous[r.user_id] = task
            tasks.append(task)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        after = await _scrape(client, url)
    bar.close()
    stats = {k: after[k] - before[k] for k in after if k in before}
    return PassResult(
        "server", [r for r in records if r is not None], wall, stats, errors=errors, conflicts=conflicts, client_observed=True
    )


def run_server(
    url: str,
    requests: list[RankingRequest],
    model_config: HSTUConfig,
    concurrency: int = 8,
    timeout_s: float = 60.0,
    progress: bool = True,
    answers: list | None = None,
    incremental: bool = False,
) -> PassResult:
    """Send `requests` to a running server, `concurrency` in flight, each user's requests in order
    (`incremental`: only the events after the user's last answered history, see hstu.client).

    A 409 (the history is shorter than the server's cached one: a workload restart, which the
    server rejects by policy) is counted in `conflicts`, any other failure in `errors`. When
    `answers` is a list, (request, hstu.client.RankResult) of every 200 is appended to it.
    """
    check_loopback(url)
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    return asyncio.run(_send_all(url, requests, model_config, concurrency, timeout_s, progress, answers, incremental))


class VerifyRefused(Exception):
    """--verify cannot check this server: its model is not the one the client can build."""


def fetch_server_model(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's model metadata (GET /v2/models/hstu)."""
    from hstu.client import Client

    check_loopback(url)
    with Client(url, timeout_s=timeout_s) as client:
        return client.model_info()


def server_reference(meta: dict[str, Any], url: str, device: torch.device) -> InferenceRankingGR:
    """The local no-cache model of the server's config and seed; VerifyRefused unless its weights
    fingerprint equals the server's."""
    config = HSTUConfig(**meta["config"])
    served = meta.get("weights_fingerprint")
    if served is None:
        raise VerifyRefused(f"--verify: the server at {url} has not loaded its model yet (no weights fingerprint)")
    model = InferenceRankingGR(config, device)
    local = model_identity(model, config).hex()
    if local != served:
        raise VerifyRefused(
            f"--verify: the server at {url} serves weights {served}, but the model built here from its config "
            f"(seed {config.seed}) has {local}; it may serve a checkpoint this client does not have"
        )
    return model


def verify_answers(
    reference: InferenceRankingGR, answers: list, task_names: list[str], batch_size: int = 8
) -> tuple[int, float]:
    """(mismatched requests, max abs logit difference) of the server's scores against `reference`.

    The server answers probabilities; they are compared as logits (log p - log(1 - p), float64),
    the scale compare_logits' per-dtype tolerance is defined on. Each probability is read as the
    float32 the server computed (it writes the shortest text of that float32), then widened."""
    tally = VerifyTally(reference.config.dtype, "server scores (as logits)")
    for start in range(0, len(answers), batch_size):
        chunk = answers[start : start + batch_size]
        requests = [request for request, _ in chunk]
        expected = torch.split(reference.forward_no_cache(requests), [r.candidates.shape[0] for r in requests])
        for (request, result), want in zip(chunk, expected):
            probs = torch.tensor([result.scores[t] for t in task_names], dtype=torch.float32).double().T
            tally.check(request.user_id, torch.log(probs) - torch.log1p(-probs), want.double().cpu())
    return tally.mismatches, tally.max_abs_diff
