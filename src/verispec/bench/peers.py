"""transformers as a peer in benchmarks: the same weights run by transformers' own ``generate``, plain, with
assisted generation (a draft model) and with prompt lookup, timed the way verispec's engine times itself.

The transformers model of a SPEC is loaded from its transformers-format directory with
``AutoModelForCausalLM``; a llama2.c checkpoint has none, so its native weights are put into a
``LlamaForCausalLM`` (:func:`to_transformers`). An early-exit draft ``layers:N`` is the same directory loaded
with ``num_hidden_layers=N``: the first N layers, the final norm and the head, as
:meth:`verispec.models.llama.Llama.first_layers` computes it.

Timing: forward hooks on the target and on the assistant add up the seconds spent in each model's forward and
count the calls; the first target call processes the prompt and yields the first token (its prefill).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from verispec.errors import UsageError
from verispec.models.llama import Llama
from verispec.models.llama2c import load_llama2c
from verispec.models.registry import model_dir

__all__ = ["PEERS", "PeerRun", "TransformersPeer", "load_transformers", "to_transformers"]

PEERS = ("transformers", "transformers-assisted", "transformers-lookup")
"""plain ``generate``; assisted generation with a draft model; prompt lookup decoding."""


def to_transformers(model: Llama, num_layers: int | None = None) -> LlamaForCausalLM:
    """A transformers ``LlamaForCausalLM`` holding the weights of a native Llama-architecture model that is
    not optimized for CPU (packed weights cannot be copied out), optionally only its first ``num_layers``
    layers (with the final norm and the head: an early-exit draft)."""
    c = model.config
    if model.optimized_for_cpu:
        raise UsageError(
            "cannot copy the weights of a model optimized for CPU; load it without the fast path"
        )
    if c.attention_bias != c.attention_out_bias or c.sliding_window is not None or c.rope_scaling is not None:
        raise UsageError("only plain Llama architectures (no RoPE scaling) convert to LlamaForCausalLM")
    layers = c.num_layers if num_layers is None else num_layers
    if not 0 < layers <= c.num_layers:
        raise UsageError(f"num_layers must be in [1, {c.num_layers}], got {num_layers!r}")
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids) or None,
    )
    hf = LlamaForCausalLM(config).eval()
    dropped = tuple(f"model.layers.{i}." for i in range(layers, c.num_layers))
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith(dropped)}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise UsageError(f"weights do not map onto LlamaForCausalLM: {sorted(unexpected or missing)[:3]}")
    hf.tie_weights()
    return hf


def load_transformers(
    spec: str, tokenizer: str | None = None, num_layers: int | None = None
) -> PreTrainedModel:
    """The transformers model of ``spec`` (float32, CPU, eval mode), or its first ``num_layers`` layers."""
    path = Path(spec).expanduser()
    if path.suffix == ".bin":  # llama2.c: no transformers directory; convert the native weights
        if tokenizer is None:
            raise UsageError(f"{path} is a llama2.c checkpoint: it needs its tokenizer file")
        return to_transformers(load_llama2c(path), num_layers)
    extra = {} if num_layers is None else {"num_hidden_layers": num_layers}
    with _quiet():  # the layers left out of an early exit are reported as unexpected weights
        model = AutoModelForCausalLM.from_pretrained(str(model_dir(spec)), dtype=torch.float32, **extra)
    return model.eval()


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings off (load reports, deprecation notes of generate's internals), then back."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@dataclass
class PeerRun:
    """What one transformers generation did, in the engine's terms."""

    token_ids: list[int]
    total_seconds: float
    prefill_seconds: float  # the first target forward: the prompt, and the first new token
    target_seconds: float  # every target forward, the first included
    target_calls: int
    draft_seconds: float
    draft_calls: int  # assistant forwards, one per drafted token


class _ForwardTimer:
    """Seconds spent in a module's forward, and the number of calls, through forward hooks."""

    def __init__(self) -> None:
        self.seconds = self.first = 0.0
        self.calls = 0
        self._start = 0.0

    def _before(self, module: nn.Module, args: tuple) -> None:
        self._start = time.perf_counter()

    def _after(self, module: nn.Module, args: tuple, output: object) -> None:
        elapsed = time.perf_counter() - self._start
        self.first = self.first or elapsed
        self.seconds += elapsed
        self.calls += 1

    @contextmanager
    def attached(self, module: nn.Module | None) -> Iterator[_ForwardTimer]:
        if module is None:
            yield self
            return
        handles = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


class TransformersPeer:
    """Generates with transformers' ``generate``: plain, assisted by ``assistant`` (K draft tokens per round,
    constant schedule, no confidence threshold), or with prompt lookup (K tokens)."""

    def __init__(self, model: PreTrainedModel, assistant: PreTrainedModel | None = None) -> None:
        self.model = model
        self.assistant = assistant

    def generate(
        self,
        prompt_ids: list[int],
        *,
        method: str,
        k: int,
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
        temperature: float,
        seed: int | None,
    ) -> PeerRun:
        """One generation by ``method`` (one of :data:`PEERS`), stopping at any of ``eos_token_ids`` or after
        ``max_new_tokens``; ``temperature`` 0 is greedy, else pure sampling at that temperature (seeded with
        ``seed`` through torch's global generator, the one transformers samples from; None: not reseeded)."""
        if method not in PEERS:
            raise UsageError(f"unknown transformers method {method!r}; choose one of {', '.join(PEERS)}")
        eos = sorted(eos_token_ids)
        options: dict = dict(
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
            do_sample=False,
        )
        if temperature > 0:
            options.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        assistant = None
        if method == "transformers-assisted":
            if self.assistant is None:
                raise UsageError("transformers assisted generation needs a draft model (--draft SPEC)")
            assistant = self.assistant
            config = assistant.generation_config  # where the candidate generator reads its settings
            config.num_assistant_tokens = k
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0
            options["assistant_model"] = assistant
        elif method == "transformers-lookup":
            options["prompt_lookup_num_tokens"] = k
        ids = torch.tensor([prompt_ids])  # [1, L]
        if seed is not None:
            torch.manual_seed(seed)
        target_timer, draft_timer = _ForwardTimer(), _ForwardTimer()
        with (
            _quiet(),
            torch.inference_mode(),
            target_timer.attached(self.model),
            draft_timer.attached(assistant),
        ):
            start = time.perf_counter()
            # [1, L + new]; generate comes from GenerationMixin, which transformers mixes into the concrete
            # model classes only (PreTrainedModel's type does not have it)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **options)  # type: ignore[operator]
            total = time.perf_counter() - start
        return PeerRun(
            token_ids=out[0, len(prompt_ids) :].tolist(),
            total_seconds=total,
            prefill_seconds=target_timer.first,
            target_seconds=target_timer.seconds,
            target_calls=target_timer.calls,
            draft_seconds=draft_timer.seconds,
            draft_calls=draft_timer.calls,
        )
