"""Large rank bodies parsed in worker processes, so parsing does not take the GIL from the model.

Decoding a 4,000-event body, checking it and hashing its identity holds the GIL for ~1 ms
(msgspec, numpy), and the model thread's host work (metadata, launches) needs the same GIL: on
the H200 at ~290 requests/s the model thread's batches took ~1.5x their in-process time with
parsing in threads of the server process. Here the parse runs in `processes` spawned workers (no
CUDA, no model: the RankBodyParser is rebuilt in each from the limits and the config); the server
process only ships bytes out and unpickles a few arrays back (the RankingRequest with its identity
chain, so the digest is not computed twice). An incremental body's full history is still rebuilt
in the server process (the history store lives there).

A worker that dies breaks the pool: the failure is logged once, and from then on bodies parse in
a thread of the server process (slower, never wrong).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from hstu.model.config import HSTUConfig
from hstu.serving.gc_policy import freeze_startup_objects
from hstu.serving.parsing import ParsedRank, RankBodyParser
from hstu.serving.schemas import RequestLimits, build_rank_columns_model, build_rank_request_model

logger = logging.getLogger(__name__)

_worker_parser: RankBodyParser | None = None


def _start_worker(limits: RequestLimits, config: HSTUConfig) -> None:
    """Worker initialiser. A Ctrl-C reaches the whole process group: the server shuts the pool down."""
    global _worker_parser
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_parser = RankBodyParser(limits, config, build_rank_request_model(limits), build_rank_columns_model(limits))
    freeze_startup_objects("parse worker")


def _parse_in_worker(raw: bytes, model_id: bytes | None) -> ParsedRank:
    parsed = _worker_parser(raw)
    if model_id is not None and parsed.prefix is None:
        r = parsed.request
        parsed.digest = r.identity(model_id).prefix(r.history_tokens(_worker_parser.config))
    return parsed


def _ready(_: int) -> bool:
    return _worker_parser is not None


class ParsePool:
    """`processes` parse workers; parse(raw, model_id) -> ParsedRank (RankError 400/422 as raised)."""

    def __init__(self, processes: int, limits: RequestLimits, config: HSTUConfig) -> None:
        if processes <= 0:
            raise ValueError(f"a parse pool needs at least one process, got {processes}")
        self.processes, self.config = processes, config
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker, initargs=(limits, config)
        )

    def start(self) -> None:
        """Spawn every worker now (each imports hstu: seconds), not on the first request."""
        if not all(self._pool.map(_ready, range(self.processes))):
            raise RuntimeError("a parse worker did not initialise")

    async def parse(self, raw: bytes, model_id: bytes | None) -> ParsedRank | None:
        """The parsed body, or None when the pool is broken (the caller parses it itself)."""
        if self._pool is None:
            return None
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(self._pool, _parse_in_worker, raw, model_id)
        except BrokenProcessPool as exc:
            if self._pool is not None:
                logger.error("the parse worker pool broke (%s); parsing in the server process from now on", exc)
                self._pool = None
            return None
        if parsed.request._valid_for == self.config:  # checked in the worker against an equal config
            parsed.request._valid_for = self.config
        return parsed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
