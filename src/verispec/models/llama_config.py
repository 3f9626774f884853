"""The shape and hyper-parameters of a Llama-family model (:class:`LlamaConfig`, from a transformers
config.json or built; validated on construction) and its RoPE scaling (:class:`RopeScaling`), with the fields
of the architectures beside Llama's that only the native kernels run (:data:`ARCHITECTURE_FIELDS`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.inputs import check_int, is_int
from verispec.kernels.cpu import ACTIVATIONS, NativeLayer, NativeStack

__all__ = ["ARCHITECTURE_FIELDS", "LlamaConfig", "RopeScaling"]

# transformers model_type → the architecture name its config.json lists
_SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class RopeScaling:
    """A rescaling of the RoPE frequencies for long contexts, as transformers' ``rope_scaling`` describes it.

    kind: "linear" (every frequency divided by ``factor``) or "llama3" (Llama 3.1's wavelength-dependent
    interpolation, using all fields).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise UsageError(f"unsupported rope_scaling type {self.kind!r} (supported: none, linear, llama3)")
        if not _is_number(self.factor) or self.factor <= 0:
            raise UsageError(f"rope_scaling factor must be a number > 0, got {self.factor!r}")
        if self.kind == "llama3":
            lo, hi = self.low_freq_factor, self.high_freq_factor
            if not (_is_number(lo) and _is_number(hi) and 0 < lo < hi):
                raise UsageError(
                    f"llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {lo}, {hi}"
                )
            if (
                not is_int(self.original_max_position_embeddings)
                or self.original_max_position_embeddings <= 0
            ):
                raise UsageError(
                    "llama3 rope_scaling needs original_max_position_embeddings > 0, "
                    f"got {self.original_max_position_embeddings!r}"
                )

    @classmethod
    def from_hf(cls, params: Mapping[str, Any], max_position_embeddings: int) -> RopeScaling | None:
        """From a transformers ``rope_scaling`` / ``rope_parameters`` dict; None for the default RoPE.

        A llama3 scaling without ``original_max_position_embeddings`` uses ``max_position_embeddings``, as
        transformers does."""
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ("linear", "llama3"):
            raise UsageError(f"unsupported rope_scaling type {kind!r} (supported: none, linear, llama3)")
        if "factor" not in params:
            raise UsageError(f"rope_scaling of type {kind!r} has no 'factor'")
        if kind == "linear":
            return cls(kind=kind, factor=params["factor"])
        for name in ("low_freq_factor", "high_freq_factor"):
            if name not in params:
                raise UsageError(f"llama3 rope_scaling has no {name!r}")
        return cls(
            kind=kind,
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position_embeddings=params.get(
                "original_max_position_embeddings", max_position_embeddings
            ),
        )


# LlamaConfig's fields for architectures beside Llama's, which only the native kernels run
ARCHITECTURE_FIELDS = (
    "qk_norm", "post_norms", "activation", "embed_scale", "attn_scale", "layer_windows", "local_rope_theta",
)  # fmt: skip


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and hyper-parameters of a Llama-family model; validated on construction (one-line UsageError).

    head_dim: width of one attention head; 0 (the default) means hidden_size // num_heads.
    attention_bias: q/k/v projections have biases (Qwen2; Llama's ``attention_bias``).
    attention_out_bias: the output projection has a bias (Llama's ``attention_bias`` sets it too; not Qwen2).
    mlp_bias: the gate/up/down projections have biases.
    sliding_window: attention span of a sliding-window model (Mistral); the model then serves contexts of at
    most this many positions, where sliding-window attention equals full attention. None: full attention.
    bos_token_id / eos_token_ids: the checkpoint's special tokens, when it names them (informational).

    The architectures beside Llama's, on the native kernels only (:attr:`native_only`): qk_norm, per-head
    RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3); post_norms, norms of the attention's and the
    MLP's outputs before the residual (Gemma 3); activation, the MLP's gate ("silu", or Gemma's
    "gelu_tanh"); embed_scale, what token embeddings are multiplied by (Gemma: sqrt(hidden_size));
    attn_scale, the attention scores' scale (None: 1 / sqrt(head_dim)); layer_windows, per layer the
    positions a token sees (0: all; Gemma 3's sliding layers), those layers' RoPE base local_rope_theta.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float | None = None
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            check_int(value, name, 1)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise UsageError(
                    f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}; "
                    "give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not is_int(self.head_dim) or self.head_dim <= 0 or self.head_dim % 2:
            raise UsageError(f"head_dim must be an even integer > 0, got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise UsageError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if not _is_number(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise UsageError(f"rms_norm_eps must be a number > 0, got {self.rms_norm_eps!r}")
        if not _is_number(self.rope_theta) or self.rope_theta <= 1:
            raise UsageError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise UsageError(
                f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}"
            )
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.sliding_window is not None:
            check_int(self.sliding_window, "sliding_window", 1)
        if self.bos_token_id is not None:
            check_int(self.bos_token_id, "bos_token_id", 0)
        if not isinstance(self.eos_token_ids, tuple) or not all(
            is_int(t) and t >= 0 for t in self.eos_token_ids
        ):
            raise UsageError(f"eos_token_ids must be a tuple of integers >= 0, got {self.eos_token_ids!r}")
        for name in ("qk_norm", "post_norms"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.activation not in ACTIVATIONS:
            raise UsageError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        for name in ("embed_scale", "attn_scale"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or value <= 0):
                raise UsageError(f"{name} must be a number > 0, got {value!r}")
        windows = self.layer_windows
        if not isinstance(windows, tuple) or (windows and len(windows) != self.num_layers):
            raise UsageError(f"layer_windows must be a tuple of one window per layer, got {windows!r}")
        if not all(is_int(w) and w >= 0 for w in windows):
            raise UsageError(f"layer_windows must be integers >= 0 (0: full attention), got {windows!r}")
        if self.local_rope_theta is not None and (
            not _is_number(self.local_rope_theta) or self.local_rope_theta <= 1
        ):
            raise UsageError(f"local_rope_theta must be a number > 1 or None, got {self.local_rope_theta!r}")

    def first_layers(self, num_layers: int) -> LlamaConfig:
        """The config of this model's first ``num_layers`` layers (their sliding windows with them)."""
        return dataclasses.replace(self, num_layers=num_layers, layer_windows=self.layer_windows[:num_layers])

    def plain_layers(self, num_layers: int) -> LlamaConfig:
        """This model's widths in ``num_layers`` plain Llama layers (a draft head's): full attention at the
        global RoPE, SiLU, none of :data:`ARCHITECTURE_FIELDS` (a Gemma 3 target's head is a Llama layer)."""
        plain: dict[str, Any] = {
            f.name: f.default for f in dataclasses.fields(self) if f.name in ARCHITECTURE_FIELDS
        }
        return dataclasses.replace(self, num_layers=num_layers, **plain)

    def architecture_fields(self) -> dict[str, Any]:
        """The fields for architectures beside Llama's (see the class docstring) that differ from their
        defaults: none for a Llama-family model."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in ARCHITECTURE_FIELDS and getattr(self, f.name) != f.default
        }

    def stack(self, layers: Sequence[NativeLayer], **settings: Any) -> NativeStack:
        """``layers`` on the native kernels as one stack of this config's sizes; ``settings``: the stack's
        others (:class:`~verispec.kernels.cpu.NativeStack`)."""
        return NativeStack(
            hidden=self.hidden_size,
            intermediate=self.intermediate_size,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            eps=self.rms_norm_eps,
            layers=layers,
            **settings,
        )

    @property
    def native_only(self) -> bool:
        """Whether the model has parts only the native kernels run (see the class docstring)."""
        return bool(self.architecture_fields())

    @property
    def max_context(self) -> int:
        """The most positions the model serves exactly: the position limit, capped by a sliding window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """From a transformers ``config.json`` dict of a llama, mistral or qwen2 model (UsageError otherwise).

        Understands both the legacy ``rope_theta`` + ``rope_scaling`` keys and transformers 5's
        ``rope_parameters``."""
        model_type = config.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise UsageError(
                f"unsupported model_type {model_type!r} "
                f"(supported: {', '.join(sorted(_SUPPORTED_MODEL_TYPES))})"
            )
        architectures = config.get("architectures") or []
        if not set(architectures) <= set(_SUPPORTED_MODEL_TYPES.values()):
            raise UsageError(
                f"unsupported architectures {architectures} (only the *ForCausalLM of {model_type})"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise UsageError(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
        if config.get("pretraining_tp", 1) not in (None, 1):
            raise UsageError(f"unsupported pretraining_tp {config['pretraining_tp']!r} (only 1)")
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in config:
                raise UsageError(f"config has no {key!r}")

        # transformers gives a legacy rope_scaling priority over rope_parameters; rope_theta may sit in either
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        if not isinstance(rope, Mapping) or any(isinstance(v, Mapping) for v in rope.values()):
            raise UsageError("per-layer rope_parameters are not supported")
        max_positions = config.get("max_position_embeddings", 2048)
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_scaling = RopeScaling.from_hf(rope, max_positions)

        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if model_type == "qwen2":
            attention_bias, attention_out_bias, mlp_bias = True, False, False
            layer_types = config.get("layer_types")
            if layer_types is not None:
                sliding = "sliding_attention" in layer_types
            else:
                sliding = config.get("num_hidden_layers", 0) > config.get("max_window_layers", 28)
            window = (
                config.get("sliding_window") if config.get("use_sliding_window", False) and sliding else None
            )
        else:
            attention_bias = attention_out_bias = bool(config.get("attention_bias", False))
            mlp_bias = bool(config.get("mlp_bias", False))
            window = config.get("sliding_window") if model_type == "mistral" else None
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=config.get("head_dim") or 0,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=attention_out_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def rope_inv_freq(self, local: bool = False) -> Tensor:
        """The RoPE inverse frequencies [head_dim // 2] float32, computed as transformers does (local: the
        sliding-window layers', from local_rope_theta, unscaled)."""
        dim = self.head_dim
        theta = self.local_rope_theta if local and self.local_rope_theta is not None else self.rope_theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = None if local else self.rope_scaling
        if scaling is None:
            return inv_freq  # [head_dim // 2]
        if scaling.kind == "linear":
            return inv_freq / scaling.factor  # [head_dim // 2]
        # llama3: keep high frequencies, divide low ones by factor, interpolate smoothly in between
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq  # [head_dim // 2]
        low = wavelen > low_freq_wavelen  # [head_dim // 2] bool
        scaled = torch.where(low, inv_freq / scaling.factor, inv_freq)  # [head_dim // 2]
        ramp = scaling.high_freq_factor - scaling.low_freq_factor
        smooth = (old_len / wavelen - scaling.low_freq_factor) / ramp  # [head_dim // 2]
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled  # [head_dim // 2]
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # [head_dim // 2] bool
        return torch.where(is_medium, smoothed, scaled)  # [head_dim // 2]
