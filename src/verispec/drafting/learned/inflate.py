"""A learned drafter for an inflated target (:mod:`verispec.models.gguf_inflate`): the same head, zero-padded.

An inflated target computes its source's function with its hidden states zero-padded (the first h places
hold the source's, the others zeros). A learned head trained beside the source reads those states and the
token embeddings (both padded the same way) and runs its own layers at the target's widths; padded the same
way as the target (each weight in the first places of each dimension, zeros elsewhere; EAGLE's ``fc`` reads
two hidden states side by side, so the columns of the second go to [H, H + h); every RMSNorm weight divided
by k = sqrt(H/h), the target's ε being divided by k² already), it computes the source head's drafts at the
inflated width's cost: its measured acceptance, beside the bigger model. Draft logits come from the target's
own head rows, which the inflated target gives unchanged.

Where inflation scales the target's residual stream by k instead (Qwen3, Gemma 3: their q/k norms keep ε),
a head's layers keep ε too, so the head's own stream is scaled the same way: ``fc``'s output (weights and
bias) and each layer's output projections (``o_proj``, ``down_proj``) times k, so every norm, divided by k,
sees the source's mean square and gives the source's output. The head's inputs need no other change: the
features it reads are the target's after its final norm (the source's), and the token embeddings are the
source's rows, times k in a Qwen3 file's table (``fc``'s embedding columns then take k less). Where a tied
Qwen3's final norm gives the source's features over k (its head is the scaled table), an EAGLE head's
feature columns take k more and its own output norm gives its features over k too; a trained exit's MLP
reads them with ``up`` times k and writes them with ``down`` over k; Medusa blocks (f + SiLU(W f + b)) have
no such form and are refused there. Lookahead tokens stand in the target's input stream, times k where it
is scaled. (EAGLE-3 heads, in their authors' layout rather than a verispec drafter file, are not read.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.drafting.learned.head import LearnedHead, native_target, target_fingerprint
from verispec.drafting.learned.kinds import load_head
from verispec.errors import UsageError
from verispec.models.base import LanguageModel
from verispec.models.gguf_inflate import Scaling

__all__ = ["inflate_drafter"]


def inflate_drafter(
    path: str | Path,
    source: LanguageModel,
    wide: LanguageModel,
    scaling: Scaling,
    out: str | Path,
    source_label: str = "",
    wide_label: str = "",
) -> Path:
    """Write the learned drafter in ``path`` (trained for ``source``) padded for ``wide``, the source
    inflated with ``scaling`` (:attr:`Inflation.scaling`), to ``out`` (atomically). UsageError (one line) for
    a file that is not ``source``'s, a ``wide`` that is not a widening of it, or a Medusa head beside a
    target whose features it cannot keep."""
    small, big = native_target(source), native_target(wide)
    head = load_head(path, small, source_label)
    a, b = small.config, big.config
    if (a.vocab_size, a.num_layers, a.head_dim) != (b.vocab_size, b.num_layers, b.head_dim) or not (
        b.hidden_size >= a.hidden_size and b.intermediate_size >= a.intermediate_size
    ):
        raise UsageError(f"{path}: the wide target is not an inflation of the drafter's target")
    if head.kind == "medusa" and scaling.features != 1.0:
        raise UsageError(f"{path}: Medusa heads are not inflated beside a target whose features are scaled")
    info = dict(head.metadata) | {
        "target": wide_label or "inflated",
        "target_fingerprint": target_fingerprint(big),
    }
    padded = type(head).from_shape(big, head.draft_vocab, info, head.shape_metadata(), Path(path))
    padded.metadata = info
    _pad_into(head, padded, a.hidden_size, b.hidden_size, scaling)
    return padded.save(out)


_OUTPUTS = ("fc.bias", "o_proj.weight", "down_proj.weight")  # what writes into an EAGLE head's own stream


def _factor(kind: str, name: str, s: Scaling) -> float:
    """What weight ``name`` of a ``kind`` head is multiplied by when padded (module doc)."""
    if kind == "eagle":
        if name.endswith("norm.weight"):  # each norm sees the source's mean square; the last gives features
            return s.features / s.k if name == "norm.weight" else 1 / s.k
        return s.stream if name.endswith(_OUTPUTS) else 1.0
    if kind == "exit":  # x + down(silu(up(x))) of features x
        return 1 / s.features if name == "up.weight" else s.features if name.startswith("down.") else 1.0
    return s.stream if kind == "lookahead" else 1.0  # lookahead tokens: inputs of the stream


def _pad_into(head: LearnedHead, padded: LearnedHead, h: int, wide: int, scaling: Scaling) -> None:
    """Copy each of ``head``'s weights into the first places of ``padded``'s, times its factor (module
    doc)."""
    target = padded.state_dict()
    with torch.no_grad():
        for name, weight in head.state_dict().items():
            into = target[name]
            into.zero_()
            if head.kind == "eagle" and name == "fc.weight":  # [h, 2h]: (embedding, feature) side by side
                into[:h, :h] = weight[:, :h] * (scaling.stream / scaling.table)
                into[:h, wide : wide + h] = weight[:, h:] * (scaling.stream / scaling.features)
                continue
            if into.dim() != weight.dim() or any(
                n < m for n, m in zip(into.shape, weight.shape, strict=True)
            ):
                raise UsageError(f"{name} {tuple(weight.shape)} does not fit in {tuple(into.shape)}")
            into[tuple(slice(0, n) for n in weight.shape)] = weight
            factor = _factor(head.kind, name, scaling)
            if factor != 1.0:
                into.mul_(factor)
