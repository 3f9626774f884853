"""A learned drafter for an inflated target (:mod:`verispec.models.gguf_inflate`): the same head, zero-padded.

An inflated target computes its source's function with its hidden states zero-padded (the first h places
hold the source's, the others zeros). A learned head trained beside the source reads those states and the
token embeddings (both padded the same way) and runs its own layers at the target's widths; padded the same
way as the target (each weight in the first places of each dimension, zeros elsewhere; EAGLE's ``fc`` reads
two hidden states side by side, so the columns of the second go to [H, H + h); every RMSNorm weight divided
by k = sqrt(H/h), the target's ε being divided by k² already), it computes the source head's drafts at the
inflated width's cost: its measured acceptance, beside the bigger model. Draft logits come from the target's
own head rows, which the inflated target gives unchanged.

Only targets whose residual stream stays the source's (Llama, Mistral, Qwen2) are read: where inflation
scales the stream (Qwen3, Gemma 3), a head would need every input rescaled as well, which is not done here.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from verispec.drafting.learned.head import LearnedHead, native_target, target_fingerprint
from verispec.drafting.learned.kinds import load_head
from verispec.errors import UsageError
from verispec.models.base import LanguageModel

__all__ = ["inflate_drafter"]


def inflate_drafter(
    path: str | Path,
    source: LanguageModel,
    wide: LanguageModel,
    out: str | Path,
    source_label: str = "",
    wide_label: str = "",
) -> Path:
    """Write the learned drafter in ``path`` (trained for ``source``) padded for ``wide``, the source
    inflated, to ``out`` (atomically). UsageError (one line) for a file that is not ``source``'s, a ``wide``
    that is not a widening of it, or a target whose inflation scales its residual stream."""
    small, big = native_target(source), native_target(wide)
    head = load_head(path, small, source_label)
    a, b = small.config, big.config
    if a.qk_norm or a.embed_scale != 1.0:
        raise UsageError(
            f"{path}: drafters are inflated beside Llama, Mistral or Qwen2 targets only (this target's "
            "inflation scales its residual stream)"
        )
    if (a.vocab_size, a.num_layers, a.head_dim) != (b.vocab_size, b.num_layers, b.head_dim) or not (
        b.hidden_size >= a.hidden_size and b.intermediate_size >= a.intermediate_size
    ):
        raise UsageError(f"{path}: the wide target is not an inflation of the drafter's target")
    info = dict(head.metadata) | {
        "target": wide_label or "inflated",
        "target_fingerprint": target_fingerprint(big),
    }
    padded = type(head).from_shape(big, head.draft_vocab, info, head.shape_metadata(), Path(path))
    padded.metadata = info
    _pad_into(head, padded, a.hidden_size, b.hidden_size)
    return padded.save(out)


def _pad_into(head: LearnedHead, padded: LearnedHead, h: int, wide: int) -> None:
    """Copy each of ``head``'s weights into the first places of ``padded``'s (module doc)."""
    norm = math.sqrt(h / wide)
    target = padded.state_dict()
    with torch.no_grad():
        for name, weight in head.state_dict().items():
            into = target[name]
            into.zero_()
            if head.kind == "eagle" and name == "fc.weight":  # [h, 2h]: (embedding, feature) side by side
                into[:h, :h] = weight[:, :h]
                into[:h, wide : wide + h] = weight[:, h:]
                continue
            if into.dim() != weight.dim() or any(
                n < m for n, m in zip(into.shape, weight.shape, strict=True)
            ):
                raise UsageError(f"{name} {tuple(weight.shape)} does not fit in {tuple(into.shape)}")
            into[tuple(slice(0, n) for n in weight.shape)] = weight
            if name.endswith("norm.weight"):
                into.mul_(norm)
