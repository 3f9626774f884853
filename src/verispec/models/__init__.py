"""Language models, caches and tokenizers behind the interfaces of :mod:`verispec.models.base`.

Its names are imported on first use (PEP 562), so that :mod:`verispec.models.names` (the SPECs the command
line checks before anything loads) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verispec.models.base import Cache, LanguageModel, Tokenizer, TreeCache, TreeLanguageModel
    from verispec.models.kv_cache import KVCache
    from verispec.models.llama import Llama
    from verispec.models.llama2c import Llama2cTokenizer, load_llama2c
    from verispec.models.llama_config import LlamaConfig, RopeScaling

_MODULES = {  # module → its public names here
    "verispec.models.base": ("Cache", "LanguageModel", "Tokenizer", "TreeCache", "TreeLanguageModel"),
    "verispec.models.kv_cache": ("KVCache",),
    "verispec.models.llama": ("Llama",),
    "verispec.models.llama_config": ("LlamaConfig", "RopeScaling"),
    "verispec.models.llama2c": ("Llama2cTokenizer", "load_llama2c"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verispec.models' has no attribute {name!r}")


__all__ = [
    "Cache",
    "KVCache",
    "LanguageModel",
    "Llama",
    "Llama2cTokenizer",
    "LlamaConfig",
    "RopeScaling",
    "Tokenizer",
    "TreeCache",
    "TreeLanguageModel",
    "load_llama2c",
]
