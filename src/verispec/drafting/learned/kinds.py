"""The learned drafter kinds by name, as the drafter registry declares them
(:class:`~verispec.drafting.registry.Trained`): each one's head class (:data:`HEADS`), the files verispec
ships for a target (:func:`shipped_drafter`), and :func:`load_head`, which reads any drafter file as the kind
it holds."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from verispec.drafting.learned.head import LearnedHead, read_drafter_file
from verispec.drafting.registry import DRAFTERS, EAGLE
from verispec.errors import UsageError
from verispec.models.base import LanguageModel

__all__ = ["HEADS", "load_head", "shipped_drafter"]

HEADS: dict[str, type[LearnedHead]] = {
    name: kind.trained.head_class() for name, kind in DRAFTERS.items() if kind.trained is not None
}


def load_head(
    path: str | Path,
    target: LanguageModel,
    target_label: str = "",
    fast: bool = False,
    kind: str | None = None,
) -> LearnedHead:
    """The learned drafter in ``path`` for ``target``, of the kind the file records, which must be ``kind``
    when given (:meth:`LearnedHead.load` for the rest; UsageError, one line, for any mismatch). A kind that
    reads a published layout (:attr:`~verispec.drafting.registry.DrafterKind.published`) reads ``path``
    as such."""
    if kind in DRAFTERS and DRAFTERS[kind].published:
        head: LearnedHead = DRAFTERS[kind].published_class().load(path, target, target_label, fast)
        return head
    metadata, tensors = read_drafter_file(path)
    found = metadata.get("kind")
    if kind is not None and found != kind:
        raise UsageError(f"{path} holds a drafter of kind {found!r}, not {kind!r}")
    if found not in HEADS:
        raise UsageError(f"{path} holds a drafter of kind {found!r}; this verispec reads {', '.join(HEADS)}")
    return HEADS[found].from_file(Path(path), metadata, tensors, target, target_label, fast)


def shipped_drafter(target_label: str, kind: str = EAGLE, auto: bool = False) -> Path | None:
    """The drafter file of ``kind`` that comes with the target named ``target_label``, when there is one:
    verispec's own for a short model name (``verispec/data/drafters``; with ``auto``, one auto may draft
    with: not a registry entry's ``on_request`` one), or for a GGUF file ``MODEL.gguf`` the file
    ``MODEL.KIND.safetensors`` beside it (as ``write-gguf --inflate --drafters`` writes them)."""
    trained = DRAFTERS[kind].trained if kind in DRAFTERS else None
    names = () if trained is None else trained.shipped if auto else (*trained.shipped, *trained.on_request)
    if target_label in names:
        name = f"{target_label}-{kind}.safetensors"
        path = Path(str(resources.files("verispec") / "data" / "drafters" / name))
    elif target_label.endswith(".gguf"):
        gguf = Path(target_label)
        path = gguf.with_name(f"{gguf.stem}.{kind}.safetensors")
    else:
        return None
    return path if path.is_file() else None
