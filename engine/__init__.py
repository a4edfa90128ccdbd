"""The ranking engine: one owner of the request pipeline (cache protocol, model thread, graphs)."""

from hstu.engine.engine import ForwardTiming, RankingEngine, RankOutput

__all__ = ["ForwardTiming", "RankingEngine", "RankOutput"]
