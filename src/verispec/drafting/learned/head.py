"""What every learned drafter shares: a small trained module in front of the target's own frozen output head,
restricted to a *draft vocabulary*, kept in one safetensors file that loads only beside its target.

A :class:`LearnedHead` holds the draft vocabulary [Vd] (target token ids, ascending), the target's
output-head rows of those tokens (borrowed, frozen, never stored), and whatever its kind trains. Its draft
logits cover the draft vocabulary only; :meth:`LearnedHead.full_q` puts a draft distribution back on the
target's vocabulary with zeros elsewhere, which is exactly the distribution a token sampled on the draft
vocabulary was drawn from (every sampling transform treats the missing tokens as impossible), so the verifier
stays exact.

A file holds the trained tensors in float16, the draft vocabulary, the kind and its shape (layers, heads, exit
layer), the training record, and the :func:`target_fingerprint` of the target it was trained for: any other
target, kind or a corrupt file is refused with a one-line :class:`~verispec.errors.UsageError`. The kinds:
:mod:`~verispec.drafting.learned.eagle` (EAGLE), :mod:`~verispec.drafting.learned.medusa` (Medusa heads),
:mod:`~verispec.drafting.learned.exit` (a trained early exit) and :mod:`~verispec.drafting.learned.lookahead`
(lookahead tokens); :mod:`~verispec.drafting.learned.kinds` reads any file by its kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.errors import UsageError
from verispec.files import atomic_path
from verispec.kernels.cpu import PackedMatrix
from verispec.models.base import LanguageModel
from verispec.models.llama import Llama, _Linear, _onednn_linear_works, _RMSNorm, pack_fitting, pack_linears
from verispec.models.llama_config import ARCHITECTURE_FIELDS

__all__ = [
    "DRAFT_FORMAT",
    "FORMAT",
    "LearnedHead",
    "native_target",
    "read_drafter_file",
    "target_fingerprint",
]

FORMAT = "verispec-drafter"  # the ``format`` entry of a drafter file's metadata
VERSION = "1"
_FINGERPRINT_ROWS = 512  # embedding rows sampled by target_fingerprint
INIT_STD = 0.02  # standard deviation of fresh weights, as Llama initialises them
_OWN_METADATA = ("format", "version", "hidden_size", "draft_vocab_size")  # written by save, not by the kind
DRAFT_FORMAT = "q8_0"  # the native kernels' format of a learned drafter's matrices (fp16 where none fits)


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
    config = dataclasses.asdict(model.config)  # architecture fields at their defaults left out, so that
    for name in set(ARCHITECTURE_FIELDS) - set(model.config.architecture_fields()):  # drafters trained
        del config[name]  # before those fields existed still name their targets
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    stride = max(1, model.vocab_size // _FINGERPRINT_ROWS)
    rows = torch.arange(0, model.vocab_size, stride, device=model.device)  # [rows]
    tensors = [model.model.embed_tokens(rows)]  # [rows, hidden]: looked up (a GGUF file's stay quantized)
    tensors += [m.weight for m in model.modules() if isinstance(m, _RMSNorm)]
    for tensor in tensors:
        digest.update(tensor.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def target_head_rows(target: Llama, ids: Tensor, chunk: int = 64) -> Tensor:
    """The rows of the target's output head for token ``ids`` [Vd]: [Vd, hidden] float32. Read through
    the logits of those tokens (:meth:`Llama.logits_of`) on unit vectors, which works whatever form the head
    takes (tied, untied, packed), ``chunk`` at a time (each chunk's logits [chunk, vocab] float32 where the
    head is not native: 67 MB for Gemma 3's 262,144 tokens at 64)."""
    hidden = target.config.hidden_size
    eye = torch.eye(hidden, device=target.device, dtype=target.dtype)  # [hidden, hidden]
    logits = target.logits_of(ids)
    columns = [logits(eye[i : i + chunk]) for i in range(0, hidden, chunk)]  # [chunk, Vd] each
    return torch.cat(columns).T.contiguous()  # [Vd, hidden]


def read_drafter_file(path: str | Path, tensors: bool = True) -> tuple[dict[str, str], dict[str, Tensor]]:
    """(metadata, tensors) of a verispec drafter file (``tensors`` False: its metadata alone, and no tensors);
    UsageError, one line, for a missing, unreadable or foreign file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no such drafter file: {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            read = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except (SafetensorError, OSError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UsageError(
            f"{path} is not a readable drafter file (corrupt or not safetensors): {first}"
        ) from None
    if metadata.get("format") != FORMAT:
        raise UsageError(f"{path} is not a verispec drafter file (its metadata has no format {FORMAT!r})")
    return metadata, read


class LearnedHead(nn.Module):
    """A learned drafter's trained module over a draft vocabulary of the target (module docstring).

    Subclasses name their ``kind``, build their trainable modules after calling this constructor, and give
    their shape to the file (:meth:`shape_metadata`) and back (:meth:`from_shape`). ``metadata`` holds the
    kind, the target's label and fingerprint, and the training record.
    """

    kind: ClassVar[str]

    def __init__(
        self,
        target: LanguageModel,
        draft_vocab: Tensor,
        metadata: dict[str, Any],
        *,
        head_rows: Tensor | None = None,
    ) -> None:
        """head_rows: the draft vocabulary's output rows [Vd, H] where the drafter brings its own (a published
        EAGLE-3 head's ``lm_head``); None: the target's own, frozen."""
        super().__init__()
        target = native_target(target)
        ids = torch.as_tensor(draft_vocab, dtype=torch.long)  # [Vd]
        vocab = target.vocab_size
        if ids.ndim != 1 or ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()):
            raise UsageError("the draft vocabulary must be a non-empty ascending list of distinct token ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise UsageError(f"draft vocabulary ids must lie in [0, {vocab}), the target's vocabulary")
        self.metadata = dict(metadata)
        self.hidden_size = target.config.hidden_size
        self.draft_vocab = nn.Buffer(ids.to(target.device), persistent=False)  # [Vd]
        if head_rows is None:
            head_rows = target_head_rows(target, self.draft_vocab)  # [Vd, H]
        rows = head_rows.to(target.device)
        self.head_weight = nn.Buffer(rows, persistent=False)  # [Vd, H]
        self.vocab_size = vocab
        self.cpu_precision: str | None = None  # its CPU fast path (optimize_for_cpu): "fp32" or DRAFT_FORMAT
        self._native_rows: PackedMatrix | None = None  # head_weight on the native kernels (DRAFT_FORMAT)

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @property
    def target_fingerprint(self) -> str:
        return self.metadata["target_fingerprint"]

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_vocab.shape[0]

    def cost_identity(self, drafter: str, **size: int) -> dict[str, Any]:
        """The cost identity of ``drafter`` drafting with this head (:meth:`Drafter.cost_identity
        <verispec.drafting.base.Drafter.cost_identity>`): its draft vocabulary, ``size`` (what the kind
        stacks: layers, heads, tokens; the rest is the target's) and its fast path."""
        return {
            "drafter": drafter,
            "draft_vocab": self.draft_vocab_size,
            **size,
            "precision": self.cpu_precision,
        }

    @property
    def training_record(self) -> dict[str, Any]:
        """The training record of the file ({}: none)."""
        training = self.metadata.get("training") or {}
        training = json.loads(training) if isinstance(training, str) else training
        return training if isinstance(training, dict) else {}

    @property
    def heldout_accuracy(self) -> list[float]:
        """The held-out top-1 agreement per draft position in the file's training record ([]: none)."""
        accuracy = self.training_record.get("heldout_top1_per_position")
        return [float(a) for a in accuracy] if isinstance(accuracy, list) else []

    @classmethod
    def create(
        cls,
        target: Llama,
        draft_vocab: Tensor,
        generator: torch.Generator,
        metadata: dict[str, Any],
        *shape: int,
    ) -> Any:
        """A fresh head of ``shape`` (layers, heads, exit layer: the constructor's last argument) with seeded
        weights: N(0, 0.02²) matrices, zero biases, unit norms; then what the kind starts from
        (:meth:`fresh_start`)."""
        head = cls(target, draft_vocab, metadata, *shape)
        head.initialise(target, generator)
        return head

    def initialise(self, target: Llama, generator: torch.Generator) -> None:
        """Seeded fresh weights: N(0, 0.02²) matrices, zero biases, unit norms; then what the kind starts
        from (:meth:`fresh_start`)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
            self.fresh_start(target)

    def fresh_start(self, target: Llama) -> None:
        """What a fresh head of the kind starts from, after the random weights (under no_grad)."""

    def logits(self, features: Tensor) -> Tensor:
        """features: [..., H] → logits over the draft vocabulary [..., Vd] float32."""
        if self._native_rows is not None:
            flat = features.reshape(-1, self.hidden_size).float()  # [N, H]
            return self._native_rows(flat).view(*features.shape[:-1], self.draft_vocab_size)  # [..., Vd]
        if self.cpu_precision == "fp32":
            return torch.ops.mkldnn._linear_pointwise(features, self.head_weight, None, "none", [], "")
        return F.linear(features, self.head_weight)

    @property
    def rows_alone(self) -> bool:
        """Whether each row of a call is computed from that row alone, bit for bit (on the native kernels):
        rows of several sequences may then run in one call."""
        return self._native_rows is not None

    def full_q(self, q_draft: Tensor) -> Tensor:
        """q_draft: [..., Vd], distributions on the draft vocabulary → the same on the target's vocabulary
        [..., V]. On the CPU in NumPy, on the calling thread (torch would split the fill over its threads)."""
        shape = (*q_draft.shape[:-1], self.vocab_size)
        if q_draft.device.type != "cpu":
            return q_draft.new_zeros(shape).index_copy_(-1, self.draft_vocab, q_draft)
        values = q_draft.numpy(force=True)  # [..., Vd]
        full = np.zeros(shape, dtype=values.dtype)  # [..., V]
        full[..., self.draft_vocab.numpy()] = values
        return torch.from_numpy(full)

    def optimize_for_cpu(self, native: bool = False, min_weight_elements: int = 2**17) -> bool:
        """The CPU fast path for drafting. ``native`` (a target on verispec's native kernels): every matrix
        of the head on those kernels in :data:`DRAFT_FORMAT` (:meth:`pack_native`), the draft logits too; each
        row of a call computed from that row alone, as the target's. Else the linears of at least
        ``min_weight_elements`` weights pre-packed for oneDNN, the draft logits on oneDNN. Irreversible, and
        for inference only: a packed head can neither be trained nor saved. Returns whether it is now on
        a fast path."""
        if self.device.type != "cpu" or self.cpu_precision is not None:
            return self.cpu_precision is not None
        if native:
            self.pack_native()
            self._native_rows = pack_fitting(self.head_weight, None, DRAFT_FORMAT)
            self.cpu_precision = self._native_rows.format
            return True
        if not _onednn_linear_works():
            return False
        pack_linears(self, 1, min_weight_elements)
        self.cpu_precision = "fp32"
        return True

    def pack_native(self) -> None:
        """The kind's trained matrices on the native kernels in :data:`DRAFT_FORMAT` (by default each linear
        on its own; a kind with decoder layers runs them as one native stack)."""
        for m in self.modules():
            if isinstance(m, _Linear):
                m.pack_native(DRAFT_FORMAT)

    # ---------------------------------------------------------------- the kind's shape

    def shape_metadata(self) -> dict[str, str]:
        """The kind's shape as file metadata entries (layers, heads, exit layer)."""
        return {}

    @classmethod
    def from_shape(
        cls, target: Llama, draft_vocab: Tensor, info: dict[str, Any], shape: dict[str, str], path: Path
    ) -> LearnedHead:
        """An untrained head of the shape that a file's metadata ``shape`` records (UsageError naming
        ``path`` for a malformed one)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- files

    def save(self, path: str | Path) -> Path:
        """Write the trained weights (float16), the draft vocabulary and the metadata as one safetensors
        file, atomically (temporary file, then rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        if self.cpu_precision is not None:
            raise UsageError("a head optimized for CPU cannot be saved: save it before optimize_for_cpu")
        tensors = {
            name: t.detach().to("cpu", torch.float16).contiguous() for name, t in self.state_dict().items()
        }
        tensors["draft_vocab"] = self.draft_vocab.to("cpu", torch.int32)
        metadata = {
            "format": FORMAT,
            "version": VERSION,
            "hidden_size": str(self.hidden_size),
            "draft_vocab_size": str(self.draft_vocab_size),
            **self.shape_metadata(),
            **{k: v if isinstance(v, str) else json.dumps(v) for k, v in self.metadata.items()},
            "kind": self.kind,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | Path, target: LanguageModel, target_label: str = "", fast: bool = False):
        """The head of this kind in ``path`` for ``target`` (``target_label`` names it in errors); ``fast``:
        then :meth:`optimize_for_cpu`, on the native kernels where the target runs on them. UsageError, one
        line, for a missing, corrupt or foreign file, a file of another kind, and a drafter trained for
        another target."""
        return cls.from_file(Path(path), *read_drafter_file(path), target, target_label, fast)

    @classmethod
    def from_file(
        cls,
        path: Path,
        metadata: dict[str, str],
        tensors: dict[str, Tensor],
        target: LanguageModel,
        target_label: str,
        fast: bool,
    ):
        """:meth:`load` of the file ``path`` already read (:func:`read_drafter_file`)."""
        if metadata.get("version") != VERSION or metadata.get("kind") != cls.kind:
            raise UsageError(
                f"{path} holds a drafter of kind {metadata.get('kind')!r}, version "
                f"{metadata.get('version')!r}; a {cls.kind} drafter of version {VERSION} was asked for"
            )
        target = native_target(target)
        fingerprint = target_fingerprint(target)
        if metadata.get("target_fingerprint") != fingerprint:
            raise UsageError(
                f"drafter {path} was trained for target {metadata.get('target', '?')!r} (fingerprint "
                f"{metadata.get('target_fingerprint')}), not for this target {target_label or '?'!r} "
                f"(fingerprint {fingerprint})"
            )
        if "draft_vocab" not in tensors:
            raise UsageError(f"{path} has no draft_vocab tensor")
        info = {k: v for k, v in metadata.items() if k not in _OWN_METADATA}
        info["training"] = json.loads(info.get("training", "{}"))
        head = cls.from_shape(target, tensors.pop("draft_vocab").long(), info, metadata, path)
        for key in head.shape_metadata():
            info.pop(key, None)
        head.metadata = info
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
            head.optimize_for_cpu(native=target.on_native_kernels)
        return head


def shape_count(shape: dict[str, str], key: str, low: int, high: int, default: str, path: Path) -> int:
    """The integer ``key`` of a file's metadata (``default`` when absent) in [low, high]; UsageError naming
    ``path`` otherwise."""
    value = shape.get(key, default)
    if not value.isdigit() or not low <= int(value) <= high:
        raise UsageError(f"{path}: {key} {value!r} is not an integer in [{low}, {high}]")
    return int(value)
