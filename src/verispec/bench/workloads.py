"""The bench's sequences of dependent requests and its shared-cache methods.

A *sequence* (the agentic tasks: ``agent_tools``, ``code_edit_loop``, ``chat_quoting``) is a prompt with
follow-ups: request j is the conversation so far — the first messages, then for each earlier request its
output (as the assistant's turn) and the next follow-up (a tool's result, an edit to make, a question quoting
the answer) — so later requests depend on earlier outputs, run in order, and re-read (and often re-emit)
them.

A drafter whose kind shares a cache across requests (``shared_cache`` in the registry: ``suffix``) runs twice:
``suffix`` starts each sample (one pass over a task's prompts) with an empty cache, ``suffix-warm`` with
what the cache held after one untimed first pass of the same workload; in both, each request's output enters
the cache as it finishes, as in a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from verispec.drafting.suffix_cache import SuffixCache

__all__ = ["WARM", "CacheSnapshots", "turns"]

WARM = "-warm"  # the suffix of a method that starts from a warm cache


def turns(
    messages: tuple[tuple[str, str], ...], follow_ups: Sequence[str], replies: Sequence[str]
) -> tuple[tuple[str, str], ...]:
    """The conversation of request ``len(replies)`` of a sequence: ``messages``, then each earlier reply (the
    assistant's) and the follow-up after it (the user's)."""
    out = list(messages)
    for reply, follow_up in zip(replies, follow_ups, strict=False):
        out += [("assistant", reply), ("user", follow_up)]
    return tuple(out)


class CacheSnapshots:
    """Per (method, task): the sequences a warm sample starts from, made once by ``first_pass`` (an untimed
    run of the workload into an empty cache)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], list[list[int]]] = {}

    def cache_for(self, method: str, task: str, first_pass: Callable[[SuffixCache], None]) -> SuffixCache:
        """A fresh cache for one sample of ``method`` on ``task``: empty, or for a warm method a copy of
        what the first pass left."""
        cache = SuffixCache()
        if not method.endswith(WARM):
            return cache
        key = (method, task)
        if key not in self._held:
            first = SuffixCache()
            first_pass(first)
            self._held[key] = first.sequences()
        for sequence in self._held[key]:
            cache.add([], sequence)
        return cache
