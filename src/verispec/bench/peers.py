"""Peers in benchmarks: the same weights run by transformers' own ``generate`` (plain, with assisted
generation from a draft model and with prompt lookup), and the same GGUF file run by llama.cpp (plain and
with its prompt lookup and constrained to a JSON schema by its grammars), timed the way verispec's engine
times itself.

The transformers model of a SPEC is loaded from its transformers-format directory with
``AutoModelForCausalLM``; a llama2.c checkpoint has none, so its native weights are put into a
``LlamaForCausalLM`` (:func:`to_transformers`). An early-exit draft ``layers:N`` is the same directory loaded
with ``num_hidden_layers=N``: the first N layers, the final norm and the head, as
:meth:`verispec.models.llama.Llama.first_layers` computes it.

Timing: forward hooks on the target and on the assistant add up the seconds spent in each model's forward and
count the calls; the first target call processes the prompt and yields the first token (its prefill).

llama.cpp runs through llama-cpp-python where it is installed (``make peers`` builds it from source into the
virtual environment); its prompt lookup is ``LlamaPromptLookupDecoding`` (n-grams of up to 2 tokens, K
guesses per round); its constrained decoding a ``LlamaGrammar`` from the schema (llama.cpp's own conversion
of a JSON schema to GBNF), made once per schema. Its extra buffer types (weight repacking for its fastest
Q4_0/Q4_K kernels, AMX tiles) are on where the CPU has no AMX, and off where it has: built for such a CPU
(``make peers``: -march=native), llama.cpp's AMX path crashed its first evaluation of every file on a
2-core Intel Xeon (2026-12-07), and the tiles cannot be switched off without the repacking.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from verispec.bench.methods import LLAMACPP_PEERS, PEERS, TRANSFORMERS_PEERS
from verispec.errors import UsageError
from verispec.kernels.build import cpu_features
from verispec.models.llama import Llama
from verispec.models.llama2c import load_llama2c
from verispec.models.names import is_llama2c
from verispec.models.registry import model_dir

if TYPE_CHECKING:  # transformers' modeling code (seconds to import) is imported where a peer is loaded
    from llama_cpp.llama_speculative import LlamaDraftModel
    from transformers import LlamaForCausalLM, PreTrainedModel

__all__ = [
    "LLAMACPP_PEERS",
    "PEERS",
    "TRANSFORMERS_PEERS",
    "LlamaCppPeer",
    "PeerRequest",
    "PeerRun",
    "TransformersPeer",
    "llamacpp_extra_buffers",
    "llamacpp_missing",
    "llamacpp_model",
    "load_transformers",
    "to_transformers",
]


def to_transformers(model: Llama, num_layers: int | None = None) -> LlamaForCausalLM:
    """A transformers ``LlamaForCausalLM`` holding the weights of a native Llama-architecture model that is
    not optimized for CPU (packed weights cannot be copied out), optionally only its first ``num_layers``
    layers (with the final norm and the head: an early-exit draft)."""
    from transformers import LlamaConfig, LlamaForCausalLM

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
    if is_llama2c(path):  # no transformers directory; convert the native weights
        if tokenizer is None:
            raise UsageError(f"{path} is a llama2.c checkpoint: it needs its tokenizer file")
        return to_transformers(load_llama2c(path), num_layers)
    from transformers import AutoModelForCausalLM

    extra = {} if num_layers is None else {"num_hidden_layers": num_layers}
    with _quiet():  # the layers left out of an early exit are reported as unexpected weights
        model = AutoModelForCausalLM.from_pretrained(str(model_dir(spec)), dtype=torch.float32, **extra)
    return model.eval()


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings off (load reports, deprecation notes of generate's internals), then back."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@dataclass(frozen=True)
class PeerRequest:
    """One generation asked of a peer: ``method`` (one of :data:`PEERS`) on ``prompt_ids``, K guesses or
    draft tokens per round where the method drafts, stopping at any of ``eos_token_ids`` or after
    ``max_new_tokens``; ``temperature`` 0 is greedy, else pure sampling at that temperature (no top-k, top-p
    or min-p), seeded with ``seed`` (None: not reseeded); ``json_schema``: the output's schema (JSON text)
    for a constrained method."""

    prompt_ids: list[int]
    method: str
    k: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    temperature: float
    seed: int | None
    json_schema: str | None = None


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

    def generate(self, request: PeerRequest) -> PeerRun:
        """One generation (sampling seeded through torch's global generator, the one transformers samples
        from)."""
        method, k, temperature = request.method, request.k, request.temperature
        if method not in TRANSFORMERS_PEERS:
            raise UsageError(
                f"unknown transformers method {method!r}; choose one of {', '.join(TRANSFORMERS_PEERS)}"
            )
        eos = sorted(request.eos_token_ids)
        options: dict = dict(
            max_new_tokens=request.max_new_tokens,
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
        ids = torch.tensor([request.prompt_ids])  # [1, L]
        if request.seed is not None:
            torch.manual_seed(request.seed)
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
            token_ids=out[0, len(request.prompt_ids) :].tolist(),
            total_seconds=total,
            prefill_seconds=target_timer.first,
            target_seconds=target_timer.seconds,
            target_calls=target_timer.calls,
            draft_seconds=draft_timer.seconds,
            draft_calls=draft_timer.calls,
        )


def llamacpp_missing() -> str | None:
    """None when llama-cpp-python is importable, else how to get it (one line)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama.cpp is not installed (`make peers` builds llama-cpp-python into .venv, ~20 minutes)"
    return None


def llamacpp_extra_buffers(cpu_flags: str) -> bool:
    """Whether llama.cpp runs with its extra buffer types (repacked weights) on a CPU of these flags (a
    /proc/cpuinfo flags line): yes unless it has AMX, whose tiles come with them and crashed it (module
    docstring)."""
    return "amx_int8" not in cpu_flags.split()


def llamacpp_model(
    gguf: Path,
    threads: int,
    context: int,
    batch: int | None = None,
    logits_all: bool = False,
    draft_model: LlamaDraftModel | None = None,
):  # llama_cpp.Llama; untyped package
    """llama.cpp on ``gguf``: ``threads`` threads, ``context`` positions, prompts evaluated ``batch`` tokens
    at a time (None: llama.cpp's default), every position's logits kept where ``logits_all``, a
    ``draft_model`` (its prompt lookup) or none; its extra buffer types as :func:`llamacpp_extra_buffers`
    says. Every bench that runs llama.cpp makes its model here."""
    import llama_cpp
    from llama_cpp import llama_cpp as bindings  # what llama_cpp.Llama reads its defaults from

    default_params = bindings.llama_model_default_params
    extra = llamacpp_extra_buffers(cpu_features())

    def with_our_buffers():
        params = default_params()
        params.use_extra_bufts = extra
        return params

    bindings.llama_model_default_params = with_our_buffers
    batching: dict[str, Any] = {} if batch is None else {"n_batch": batch}  # None: llama-cpp-python's default
    try:
        return llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=context,
            **batching,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            draft_model=draft_model,
            verbose=False,
        )
    finally:
        bindings.llama_model_default_params = default_params


class LlamaCppPeer:
    """Generates with llama.cpp (llama-cpp-python) on a GGUF file: plain decoding, its prompt lookup with K
    guesses per round, or plain decoding held to a JSON schema by its grammar. Each generation starts from an
    empty context (no prompt reused from the last one)."""

    def __init__(self, gguf: Path, threads: int, context: int) -> None:
        missing = llamacpp_missing()
        if missing is not None:
            raise UsageError(missing)
        self.gguf, self.threads, self.context = gguf, threads, context
        self._models: dict[int, object] = {}  # K (0: plain) → its llama_cpp.Llama
        self._grammars: dict[str, object] = {}  # a JSON schema's text → its llama_cpp.LlamaGrammar

    def _model(self, k: int):  # llama_cpp.Llama; untyped package
        if k not in self._models:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self._models[k] = llamacpp_model(
                self.gguf,
                self.threads,
                self.context,
                logits_all=k > 0,  # the lookup verifies every guess's position
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None,
            )
        return self._models[k]

    def _grammar(self, schema: str):  # llama_cpp.LlamaGrammar
        if schema not in self._grammars:
            from llama_cpp import LlamaGrammar

            self._grammars[schema] = LlamaGrammar.from_json_schema(schema, verbose=False)
        return self._grammars[schema]

    def generate(self, request: PeerRequest) -> PeerRun:
        """One generation (sampling by llama.cpp's own sampler). Forward calls are not counted (llama.cpp
        does not report them): 0."""
        if request.method not in LLAMACPP_PEERS:
            choices = ", ".join(LLAMACPP_PEERS)
            raise UsageError(f"unknown llama.cpp method {request.method!r}; choose one of {choices}")
        model = self._model(request.k if request.method == "llamacpp-lookup" else 0)
        model.reset()
        if request.seed is not None:
            model.set_seed(request.seed)
        options = dict(temp=request.temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        if request.method == LLAMACPP_PEERS[-1]:
            if request.json_schema is None:
                raise UsageError(f"{request.method} needs a JSON schema")
            options["grammar"] = self._grammar(request.json_schema)
        tokens: list[int] = []
        start = time.perf_counter()
        first = 0.0
        for token in model.generate(request.prompt_ids, reset=True, **options):
            first = first or time.perf_counter() - start
            tokens.append(int(token))
            if token in request.eos_token_ids or len(tokens) == request.max_new_tokens:
                break
        total = time.perf_counter() - start
        return PeerRun(
            token_ids=tokens,
            total_seconds=total,
            prefill_seconds=first,
            target_seconds=total,
            target_calls=0,
            draft_seconds=0.0,
            draft_calls=0,
        )
