"""Language models, caches and tokenizers behind the interfaces of :mod:`verispec.models.base`."""

from verispec.models.base import Cache, LanguageModel, Tokenizer, TreeCache, TreeLanguageModel
from verispec.models.llama import KVCache, Llama, LlamaConfig, RopeScaling
from verispec.models.llama2c import Llama2cTokenizer, load_llama2c

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
