"""What a model's cost depends on, as a JSON-able dict: the key under which its calibrated costs are cached
(:mod:`verispec.costs.calibrate`) and part of each drafter's own cost identity (``Drafter.cost_identity``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from verispec.kernels.build import library_path
from verispec.models.base import LanguageModel

__all__ = ["model_identity"]

_HF_VERSION = "transformers_version"  # a transformers config's field that says nothing of its shape


def model_identity(model: LanguageModel) -> dict:
    """What a model's cost depends on: its class and architecture config, dtype, device, the precision of its
    CPU fast path, and on the native kernels the build they run (a new source or compiler measures again)."""
    config: Any = getattr(model, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        arch = dataclasses.asdict(config)
    elif hasattr(config, "to_dict"):  # a transformers config; its private and version fields are not shape
        arch = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != _HF_VERSION}
    else:
        arch = {"vocab_size": model.vocab_size, "max_context": model.max_context}
    fast_path = getattr(model, "cpu_precision", None)
    identity = {
        "class": type(model).__name__,
        "config": arch,
        "dtype": str(getattr(model, "dtype", "")),
        "device": str(model.device),
        "fast_path": fast_path,  # the CPU fast path's weights (native models)
        "kernels": library_path().name if fast_path not in (None, "fp32") else None,
    }
    head = getattr(getattr(model, "_native_head", None), "format", None)
    if head is not None and head != ("q8_0" if fast_path == "q4_1" else fast_path):
        identity["head"] = head  # a GGUF file's own head read in place, in another format than packing's
    return identity
