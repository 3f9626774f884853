"""EAGLE-1 and EAGLE-2 heads as their authors publish them (Li et al. 2024; EAGLE-2 drafts with EAGLE-1's
heads, its dynamic trees being the drafting, not the file), read beside their target.

The layout, read from SafeAILab/EAGLE at cb7e0841 (``eagle/model/cnets1.py``, ``eagle/model/ea_model.py``):

- ``model.safetensors``: ``fc.weight`` [H, 2H] and ``fc.bias`` [H] (none where config.json says
  ``"bias": false``) over [embed(x_{t+1}) ; f_t], f_t the target's final hidden state (after its last norm);
  decoder layers ``layers.{i}.*`` (``num_hidden_layers`` of them, usually one) as a Llama's, except that
  layer 0 has no ``input_layernorm``; no final norm: the last layer's output is f̂_{t+1}, which the target's
  own output head turns into the draft logits over the whole vocabulary and which the next draft step reads
  as its feature. The embedding is the target's (``embed_tokens.weight``, where a file has it, instead).
- ``config.json``: a Llama config of the head (``hidden_size``, ``intermediate_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``rope_theta``, ``vocab_size``,
  ``num_hidden_layers``; ``bias``, ``qkv_bias`` where given).

It drafts as verispec's own eagle head does (:class:`~verispec.drafting.learned.eagle_drafter.EagleDrafter`,
chains and trees, dynamic ones being EAGLE-2's), in float32 torch, its q over the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from verispec.drafting.learned.eagle import MAX_LAYERS, TokenRows
from verispec.drafting.learned.eagle3 import PublishedHead, check_layout, layer_config, read_published
from verispec.drafting.learned.eagle_drafter import EagleDrafter
from verispec.drafting.learned.head import LearnedHead, native_target
from verispec.errors import UsageError
from verispec.inputs import is_int
from verispec.models.base import LanguageModel
from verispec.models.kv_cache import RowsBeside
from verispec.models.llama import Llama, _DecoderLayer, _Linear, run_layers
from verispec.models.llama_config import LlamaConfig

__all__ = ["Eagle2Drafter", "Eagle2Head"]


class Eagle2Head(PublishedHead):
    """A published EAGLE-1/2 head (module docstring) beside its target: an :class:`EagleHead` without the
    first layer's input norm and without a final norm (it has no ``norm``: only the native path, never taken,
    reads one), over the whole vocabulary. Read with :meth:`load`."""

    kind = "eagle2"

    def __init__(
        self, target: Llama, config: LlamaConfig, bias: bool, tensors: dict[str, Tensor], where: Path
    ) -> None:
        LearnedHead.__init__(self, target, torch.arange(target.vocab_size), {"published": str(where)})
        device, h = target.device, target.config.hidden_size
        self.config = config
        self.fc = _Linear(2 * h, h, bias, device, torch.float32)
        self.layers = nn.ModuleList(
            [_DecoderLayer(config, device, torch.float32) for _ in range(config.num_layers)]
        )
        self.layers[0].register_module("input_layernorm", nn.Identity())  # layer 0 reads fc's output as is
        self.embed = TokenRows.of(target, self.draft_vocab, tensors.get("embed_tokens.weight"))
        self.inv_freq = nn.Buffer(config.rope_inv_freq().to(device), persistent=False)
        self._stack = None
        self._draft_head = None
        self._rows = RowsBeside()
        shapes = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        check_layout(
            tensors,
            shapes,
            {"embed_tokens.weight": (target.vocab_size, h)},
            where,
            "EAGLE-1/2",
            " (an EAGLE-3 head's midlayer.*: --drafter eagle3)"
            if "midlayer.hidden_norm.weight" in tensors
            else "",
        )
        with torch.no_grad():
            for name, param in self.state_dict().items():
                param.copy_(tensors[name])

    @classmethod
    def load(cls, path: str | Path, target: LanguageModel, target_label: str = "", fast: bool = False):
        """The published head at ``path`` (a directory with config.json and model.safetensors, or the
        safetensors file) for ``target``; ``fast``: on the native kernels beside a target on them
        (:class:`~verispec.drafting.learned.eagle3.PublishedHead`). UsageError, one line, for a head that does
        not fit the target or misses a tensor."""
        weights, config, tensors = read_published(path)
        model = native_target(target)
        layers = config.get("num_hidden_layers", 1)
        if not is_int(layers) or not 1 <= layers <= MAX_LAYERS:
            raise UsageError(f"{weights}: num_hidden_layers {layers!r} is not in [1, {MAX_LAYERS}]")
        qkv_bias = bool(config.get("qkv_bias", False))  # q, k and v only, as EAGLE's code reads it
        layer = layer_config({**config, "attention_bias": qkv_bias}, model, weights, layers)
        layer = dataclasses.replace(layer, attention_out_bias=False)
        head = cls(model, layer, bool(config.get("bias", True)), tensors, weights)
        head.optimize_for_cpu(native=fast and model.on_native_kernels)
        return head

    def forward(
        self, tokens: Tensor, features: Tensor, positions: Tensor, cache: Any, mask: Tensor | None = None
    ) -> Tensor:
        """As :meth:`EagleHead.forward` (f̂ [B, T, H] from tokens, features and positions [B, T]), on the
        float path, with no final norm."""
        embedded = self.embed(tokens)  # [B, T, H]
        h = self.fc(torch.cat((embedded, features.float()), dim=-1))  # [B, T, H]
        return run_layers(self.layers, h, positions, cache, self.inv_freq, mask)  # type: ignore[arg-type]


class Eagle2Drafter(EagleDrafter):
    """:class:`EagleDrafter` with a published EAGLE-1/2 head (the target's final hidden states its
    features)."""

    name = "eagle2"
