"""The EAGLE-style draft head: one transformer layer that predicts the target's next hidden state.

At slot t the head reads the pair (embed(x_{t+1}), f_t) — the embedding of token t+1 and the target's final
hidden state f_t at position t (after its last norm: the state whose logits predict x_{t+1}) — and predicts
f̂_{t+1}, from which the target's own output head, restricted to a *draft vocabulary* (the most frequent
target tokens of the training data), gives the logits of x_{t+2}::

    (embed(x_{t+1}), f_t) → fc (2H → H) → Llama decoder layer(s) → RMSNorm → f̂_{t+1} → target head rows

Drafting feeds the target's true features of the committed tokens, then runs on its own predictions
(Li et al. 2024, EAGLE). The embeddings and the head rows come from the target, frozen and never stored: a
drafter file holds only fc, the layer and the norm (float16), the draft vocabulary and metadata, and loads
only beside the target whose :func:`target_fingerprint` it records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.errors import UsageError
from verispec.models.base import LanguageModel
from verispec.models.llama import (
    KVCache,
    Llama,
    _DecoderLayer,
    _Linear,
    _onednn_linear_works,
    _RMSNorm,
    pack_linears,
    run_layers,
)

__all__ = ["FORMAT", "KINDS", "EagleHead", "native_target", "target_fingerprint"]

FORMAT = "verispec-drafter"  # the ``format`` entry of a drafter file's metadata
_VERSION = "1"
KINDS = ("eagle",)  # the drafter kinds verispec trains
_FINGERPRINT_ROWS = 512  # embedding rows sampled by target_fingerprint
_INIT_STD = 0.02  # standard deviation of fresh weights, as Llama initialises them
MAX_LAYERS = 8  # the most decoder layers a head may have


def native_target(model: LanguageModel) -> Llama:
    """``model`` itself when it is a native Llama-family model (the only targets learned drafters read the
    hidden states of); UsageError otherwise."""
    if not isinstance(model, Llama):
        raise UsageError(
            "learned drafters need a native Llama-family target (llama, mistral, qwen2 checkpoints); "
            f"this target runs as a {type(model).__name__}"
        )
    return model


def target_fingerprint(model: LanguageModel) -> str:
    """A short hash naming the target's weights: its config, a strided sample of the token embeddings and
    every RMSNorm weight, rounded to bfloat16 first (so that float32 and half-precision copies of one
    checkpoint agree). The projection weights are left out: the CPU fast path holds them in a packed form."""
    model = native_target(model)
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True).encode())
    embed = model.model.embed_tokens.weight  # [vocab, hidden]
    tensors = [embed[:: max(1, embed.shape[0] // _FINGERPRINT_ROWS)]]
    tensors += [m.weight for m in model.modules() if isinstance(m, _RMSNorm)]
    for tensor in tensors:
        digest.update(tensor.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def _head_rows(target: Llama, ids: Tensor, chunk: int = 256) -> Tensor:
    """The rows of the target's output head for token ``ids`` [Vd]: [Vd, hidden] float32. Read through
    ``target.logits`` on unit vectors, which works whatever form the head takes (tied, untied, packed)."""
    hidden = target.config.hidden_size
    eye = torch.eye(hidden, device=target.device, dtype=target.dtype)  # [hidden, hidden]
    columns = [target.logits(eye[i : i + chunk].unsqueeze(0))[0][:, ids] for i in range(0, hidden, chunk)]
    return torch.cat(columns).T.contiguous()  # [Vd, hidden]


class EagleHead(nn.Module):
    """The draft head of a target (see the module docstring). Trainable: ``fc``, ``layers``, ``norm``.

    Build a fresh one with :meth:`create` or read a file with :meth:`load`; ``config`` is the target's with
    ``num_layers`` layers (one, as in EAGLE, unless asked). ``draft_vocab`` [Vd] int64 holds the target token
    id of each draft logit, ascending.
    """

    def __init__(
        self, target: LanguageModel, draft_vocab: Tensor, metadata: dict[str, Any], num_layers: int = 1
    ) -> None:
        super().__init__()
        target = native_target(target)
        ids = torch.as_tensor(draft_vocab, dtype=torch.long)  # [Vd]
        vocab = target.vocab_size
        if ids.ndim != 1 or ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()):
            raise UsageError("the draft vocabulary must be a non-empty ascending list of distinct token ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise UsageError(f"draft vocabulary ids must lie in [0, {vocab}), the target's vocabulary")
        if (
            isinstance(num_layers, bool)
            or not isinstance(num_layers, int)
            or not 1 <= num_layers <= MAX_LAYERS
        ):
            raise UsageError(f"a draft head has 1 to {MAX_LAYERS} decoder layers, got {num_layers!r}")
        self.config = dataclasses.replace(target.config, num_layers=num_layers)
        self.metadata = dict(metadata)  # kind, target label and fingerprint, training settings
        h, device = self.config.hidden_size, target.device
        self.fc = _Linear(2 * h, h, True, device, torch.float32)
        self.layers = nn.ModuleList(
            [_DecoderLayer(self.config, device, torch.float32) for _ in range(num_layers)]
        )
        self.norm = _RMSNorm(h, self.config.rms_norm_eps, device, torch.float32)
        self.draft_vocab = nn.Buffer(ids.to(device), persistent=False)  # [Vd]
        # frozen, borrowed from the target: token embeddings (shared, not copied) and the head's rows
        self.embed_weight = nn.Buffer(target.model.embed_tokens.weight.detach(), persistent=False)  # [V, H]
        self.head_weight = nn.Buffer(_head_rows(target, self.draft_vocab), persistent=False)  # [Vd, H]
        self.inv_freq = nn.Buffer(self.config.rope_inv_freq().to(device), persistent=False)  # [head_dim // 2]
        self.vocab_size = vocab
        self._onednn_logits = False  # the draft logits run on oneDNN (see optimize_for_cpu)

    @classmethod
    def create(
        cls,
        target: Llama,
        draft_vocab: Tensor,
        generator: torch.Generator,
        metadata: dict[str, Any],
        num_layers: int = 1,
    ) -> EagleHead:
        """A fresh head with seeded random weights: N(0, 0.02²) matrices and zero biases, unit norms but the
        output norm, which starts as the target's final norm (its output then has the target's scale)."""
        head = cls(target, draft_vocab, metadata, num_layers)
        with torch.no_grad():
            for name, param in head.named_parameters():
                if name == "norm.weight":
                    param.copy_(target.model.norm.weight)
                elif name.endswith("layernorm.weight"):
                    param.fill_(1.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * _INIT_STD)
        return head

    @property
    def target_fingerprint(self) -> str:
        return self.metadata["target_fingerprint"]

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_vocab.shape[0]

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def adopt(self, other: EagleHead) -> None:
        """Take the weights of ``other``, a head of the same target and draft vocabulary with at most this
        head's layers: its fc, layers and norm; this head's further layers get zero output projections
        (attention ``o_proj``, MLP ``down_proj``), so that they add nothing to the residual stream until
        trained and the two heads compute the same features."""
        if other.num_layers > self.num_layers or not torch.equal(other.draft_vocab, self.draft_vocab):
            raise UsageError(
                f"cannot start a {self.num_layers}-layer head from a {other.num_layers}-layer one"
                if other.num_layers > self.num_layers
                else "cannot start a head from one with another draft vocabulary"
            )
        with torch.no_grad():
            own = self.state_dict()
            for name, tensor in other.state_dict().items():
                own[name].copy_(tensor)
            for layer in self.layers[other.num_layers :]:
                assert isinstance(layer, _DecoderLayer)  # what __init__ fills the ModuleList with
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()

    def new_cache(
        self, batch_size: int = 1, capacity: int | None = None, separate_layers: bool = False
    ) -> KVCache:
        """An empty cache of the head's layers (default capacity: the target's context; ``separate_layers``
        for training, see :class:`~verispec.models.llama.KVCache`)."""
        c = self.config
        capacity = c.max_context if capacity is None else capacity
        return KVCache(
            self.num_layers,
            batch_size,
            c.num_kv_heads,
            capacity,
            c.head_dim,
            dtype=torch.float32,
            device=self.inv_freq.device,
            separate_layers=separate_layers,
        )

    def forward(
        self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None = None
    ) -> Tensor:
        """tokens: [B, T] int64, x_{t+1} at each slot t; features: [B, T, H], f_t (true or predicted);
        positions: [B, T] int64, the slots t. Returns f̂_{t+1}: [B, T, H] float32; appends T slots to
        ``cache``. mask: [T, cache.length + T] bool (True = attend), None for causal attention."""
        embedded = F.embedding(tokens, self.embed_weight).float()  # [B, T, H]
        h = self.fc(torch.cat((embedded, features.float()), dim=-1))  # [B, T, H]
        # run_layers takes the _DecoderLayers of the ModuleList, whose items torch types as plain Modules
        h = run_layers(self.layers, h, positions, cache, self.inv_freq, mask)  # type: ignore[arg-type]
        return self.norm(h)

    def logits(self, features: Tensor) -> Tensor:
        """features: [M, H] or [B, T, H] → logits over the draft vocabulary [M, Vd] or [B, T, Vd] float32."""
        if self._onednn_logits:
            return torch.ops.mkldnn._linear_pointwise(features, self.head_weight, None, "none", [], "")
        return F.linear(features, self.head_weight)

    def optimize_for_cpu(self, min_weight_elements: int = 2**17) -> bool:
        """The CPU fast path for drafting (one token per call), as :meth:`Llama.optimize_for_cpu`: the linears
        of at least ``min_weight_elements`` weights pre-packed for oneDNN, the draft logits on oneDNN.
        Irreversible, and for inference only: a packed head can neither be trained nor saved. Returns whether
        anything now runs on oneDNN (never on CUDA, or where oneDNN does not work)."""
        if self.inv_freq.device.type != "cpu" or not _onednn_linear_works():
            return False
        pack_linears(self, 1, min_weight_elements)
        self._onednn_logits = True
        return True

    # ---------------------------------------------------------------- files

    def save(self, path: str | Path) -> Path:
        """Write the trained weights (float16), the draft vocabulary and the metadata as one safetensors
        file, atomically (temporary file, then rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        if any(isinstance(m, _Linear) and m.packed for m in self.modules()):
            raise UsageError("a head optimized for CPU cannot be saved: save it before optimize_for_cpu")
        tensors = {
            name: t.detach().to("cpu", torch.float16).contiguous() for name, t in self.state_dict().items()
        }
        tensors["draft_vocab"] = self.draft_vocab.to("cpu", torch.int32)
        metadata = {
            "format": FORMAT,
            "version": _VERSION,
            "hidden_size": str(self.config.hidden_size),
            "draft_vocab_size": str(self.draft_vocab_size),
            "num_layers": str(self.num_layers),
            **{k: v if isinstance(v, str) else json.dumps(v) for k, v in self.metadata.items()},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(
        cls, path: str | Path, target: LanguageModel, target_label: str = "", fast: bool = False
    ) -> EagleHead:
        """The head in ``path`` for ``target`` (``target_label`` names it in errors); ``fast``: then
        :meth:`optimize_for_cpu`. UsageError, one line, for a missing, corrupt or foreign file, and for a
        drafter trained for another target."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise UsageError(f"no such drafter file: {path}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, RuntimeError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UsageError(
                f"{path} is not a readable drafter file (corrupt or not safetensors): {first}"
            ) from None
        if metadata.get("format") != FORMAT:
            raise UsageError(f"{path} is not a verispec drafter file (its metadata has no format {FORMAT!r})")
        if metadata.get("version") != _VERSION or metadata.get("kind") not in KINDS:
            raise UsageError(
                f"{path} holds a drafter of kind {metadata.get('kind')!r}, version "
                f"{metadata.get('version')!r}; this verispec reads kinds {', '.join(KINDS)} "
                f"of version {_VERSION}"
            )
        fingerprint = target_fingerprint(target)
        if metadata.get("target_fingerprint") != fingerprint:
            raise UsageError(
                f"drafter {path} was trained for target {metadata.get('target', '?')!r} (fingerprint "
                f"{metadata.get('target_fingerprint')}), not for this target {target_label or '?'!r} "
                f"(fingerprint {fingerprint})"
            )
        if "draft_vocab" not in tensors:
            raise UsageError(f"{path} has no draft_vocab tensor")
        info = {
            k: v
            for k, v in metadata.items()
            if k not in ("format", "version", "hidden_size", "draft_vocab_size", "num_layers")
        }
        info["training"] = json.loads(info.get("training", "{}"))
        layers = metadata.get("num_layers", "1")  # files written before heads had a layer count: one
        if not layers.isdigit() or not 1 <= int(layers) <= MAX_LAYERS:
            raise UsageError(f"{path}: num_layers {layers!r} is not a layer count in [1, {MAX_LAYERS}]")
        head = cls(target, tensors.pop("draft_vocab").long(), info, int(layers))
        expected = head.state_dict()
        if set(tensors) != set(expected):
            raise UsageError(
                f"{path} holds tensors {sorted(set(tensors) ^ set(expected))[:3]} this head does not"
            )
        with torch.no_grad():
            for name, tensor in tensors.items():
                if tensor.shape != expected[name].shape:
                    raise UsageError(
                        f"{path}: {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(expected[name].shape)}"
                    )
                expected[name].copy_(tensor)
        if fast:
            head.optimize_for_cpu()
        return head
