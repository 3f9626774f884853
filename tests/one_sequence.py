"""Tests' batch of one: an engine with one drafter, K policy and trace for every sequence it decodes, each
submitted as the engine's own requests are (its one way in)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from verispec.costs.policies import KPolicy
from verispec.drafting.base import Drafter, TreeDrafter
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import EngineConfig, GenerationStats, Request
from verispec.trace import TraceRecorder


class OneSequence:
    """``SpeculativeEngine(target)`` decoding with ``drafter``, ``k_policy`` and ``trace``; checks the drafter
    against the target and cache at once, as a request's admission would."""

    def __init__(
        self,
        target: Any,
        drafter: Drafter | TreeDrafter,
        k_policy: KPolicy,
        trace: TraceRecorder | object | None = None,
    ) -> None:
        self.engine = SpeculativeEngine(target)
        self.drafter, self.k_policy, self.trace = drafter, k_policy, trace
        self.engine._check_drafter(drafter, trace, self.engine.cache)

    def __getattr__(self, name: str) -> Any:  # the engine's cache, forwards, ...
        return getattr(self.engine, name)

    def stream(
        self,
        prompt: list[int],
        config: EngineConfig,
        stats: GenerationStats,
        stop_check: Callable[[list[int]], int | None] | None = None,
    ) -> Iterator[list[int]]:
        """Yields the tokens each round commits for ``prompt``; ``stats`` filled in as it goes."""
        request = Request(prompt, config, self.drafter, self.k_policy, stats, stop_check, self.trace)  # type: ignore[arg-type]
        yield from self.engine.follow(self.engine.submit(request))
