"""Which models to load and which drafter drafts for them, by name: :class:`ModelChoice`, checked on
construction and before anything loads (:meth:`ModelChoice.check_models`), then loaded by
:func:`verispec.resolve.resolve` (its one argument) or :meth:`verispec.resolve.Target.load` (a target loaded
once, drafted for by any number of drafters).

Light to import (no torch): the command line checks a choice with it before it loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, Unpack

from verispec.drafting.registry import AUTO
from verispec.errors import UsageError
from verispec.models.names import DEFAULT_MODEL, is_llama2c  # light: no torch

if TYPE_CHECKING:
    from typing import TypeAlias

    from verispec.drafting.suffix_cache import SuffixCache
    from verispec.models.base import LanguageModel, Tokenizer

    Loadable: TypeAlias = (
        str | tuple[LanguageModel, Tokenizer]
    )  # a SPEC, or a model loaded with its tokenizer

__all__ = ["DEFAULT_PRECISION", "DrafterFields", "ModelChoice"]

DEFAULT_PRECISION = "auto"  # the weights models load in unless told (verispec.models.llama.resolve_precision)


class DrafterFields(TypedDict, total=False):
    """What a drafter drafts from, as :class:`ModelChoice` names it (beside its ``drafter``)."""

    draft: Loadable | None
    drafter_path: str | None
    draft_tokenizer: str | None
    cross_tokenizer: str


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """The models to load and the drafter to draft with, as a config (``verispec serve``, ``verispec batch``
    extend it): :func:`~verispec.resolve.resolve`'s one argument, the :class:`~verispec.api.Speculator`
    arguments that name files and choices; the drafter's choice checked on construction
    (:func:`~verispec.drafting.registry.check_choice`: its name, its draft, file and tokenizer together), the
    models and files it names before it loads (:meth:`check_models`). ``target`` names the target (a SPEC;
    beside a target already loaded, :class:`~verispec.resolve.Target`, its label alone); ``draft`` is a SPEC
    or, from the library, a draft already loaded with its tokenizer."""

    target: str = DEFAULT_MODEL
    tokenizer: str | None = None
    draft: Loadable | None = None
    draft_tokenizer: str | None = None  # the draft's own tokenizer file (a llama2.c draft)
    cross_tokenizer: str = "auto"  # with a draft of another tokenizer: tli, string or auto
    drafter: str = AUTO
    drafter_path: str | None = None
    precision: str = DEFAULT_PRECISION
    device: str = "cpu"  # the torch device models load on (verispec.resolve.check_device)
    suffix_cache_file: str | None = None  # a suffix drafter's cache: loaded at start, saved at exit
    suffix_budget: int | None = None  # its budget in tokens (None: the saved one, else the default)

    def __post_init__(self) -> None:
        from verispec.drafting.registry import check_choice
        from verispec.drafting.suffix_files import check_suffix_choice  # numpy, no torch

        check_choice(self.draft, self.drafter, self.drafter_path, self.draft_tokenizer, self.cross_tokenizer)
        check_suffix_choice(self.drafter, self.suffix_cache_file, self.suffix_budget)

    def check_models(self, target: bool = True) -> None:
        """UsageError for a model or file this choice names that cannot work, known without loading anything
        (:func:`~verispec.models.names.check_spec`): the target (``target``) with its tokenizer, the draft
        with its own tokenizer (else the target's), a drafter file that is not there."""
        from pathlib import Path

        from verispec.drafting.registry import DRAFTERS, early_exit_layers, self_draft
        from verispec.models.names import check_spec

        if target:
            check_spec(self.target, self.tokenizer)
        if self.tokenizer is not None:
            check_spec(self.tokenizer, model=False)
        draft = self.draft
        if isinstance(draft, str) and early_exit_layers(draft) is None and self_draft(draft) is None:
            check_spec(
                draft, self.draft_tokenizer_spec, tokenizer_flag="--draft-tokenizer, or draft_tokenizer="
            )
            if self.draft_tokenizer is not None:
                check_spec(self.draft_tokenizer, model=False)
        if self.drafter_path is not None and not Path(self.drafter_path).expanduser().is_file():
            published = self.drafter in DRAFTERS and DRAFTERS[self.drafter].published  # its directory too
            if not (published and Path(self.drafter_path).expanduser().is_dir()):
                raise UsageError(f"no such drafter file: {self.drafter_path}")

    @property
    def draft_tokenizer_spec(self) -> str | None:
        """The tokenizer a draft model loads with: ``draft_tokenizer``, else for a llama2.c checkpoint (which
        has none of its own) the target's ``tokenizer``, else None: the draft's own (a GGUF draft beside a
        llama2.c target speaks its own vocabulary, drafting across tokenizers)."""
        if self.draft_tokenizer is not None:
            return self.draft_tokenizer
        draft = self.draft
        return self.tokenizer if isinstance(draft, str) and is_llama2c(draft) else None

    def with_drafter(self, drafter: str, **fields: Unpack[DrafterFields]) -> ModelChoice:
        """The same target (SPEC, tokenizer, precision, device) with another drafter and what it drafts from
        (``fields``), checked as on construction; no suffix cache file (a shared cache starts empty)."""
        return ModelChoice(
            target=self.target, tokenizer=self.tokenizer, precision=self.precision, device=self.device,
            drafter=drafter, **fields,
        )  # fmt: skip

    def save_suffix_cache(self, cache: SuffixCache | None) -> None:
        """Save ``cache`` to ``suffix_cache_file`` (atomically), when both are given."""
        if cache is not None and self.suffix_cache_file is not None:
            cache.save(self.suffix_cache_file)
