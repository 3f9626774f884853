"""EAGLE-3 heads as their authors publish them (Li et al. 2025), read beside a Llama-family or Qwen target.

The layout, read from the sources rather than guessed (SafeAILab/EAGLE at cb7e0841: ``eagle/model/cnets.py``,
``eagle/model/modeling_llama_kv.py``, ``eagle/traineagle3/cnets.py`` and ``config.json``; vLLM's
``vllm/model_executor/models/llama_eagle3.py`` at 00bd1493):

- ``model.safetensors`` (float16 or bfloat16): ``fc.weight`` [H, 3H] (no bias) fusing three of the target's
  hidden states; one decoder layer ``midlayer.*`` — ``input_layernorm`` (of the token's embedding) and
  ``hidden_norm`` (of the fused state), ``self_attn.{q,k,v}_proj`` over their concatenation [embedding ;
  state] (2H wide), ``self_attn.o_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``; the final
  ``norm.weight``; ``lm_head.weight`` [Vd, H] over a draft vocabulary; ``d2t`` [Vd] int64, draft id d →
  target id d + d2t[d]; ``t2d`` [V] bool, the target ids drafted. The embedding is the target's
  (``embed_tokens.weight``, when a file has it, is read instead).
- ``config.json`` (``LlamaForCausalLMEagle3`` or ``LlamaForCausalLM``): ``hidden_size``,
  ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``rope_theta``
  (10000 when absent), ``vocab_size``, ``draft_vocab_size``, maybe ``target_hidden_size``, and the target
  layers read, ``eagle_aux_hidden_state_layer_ids`` (at the top or in ``eagle_config``; default
  (2, N // 2, N − 3) for a target of N layers, as EAGLE's and vLLM's code).

The three features are the residual stream *entering* those layers of the target (layer 0's: the
embedding), side by side in ascending layer order (:meth:`~verispec.models.llama.Llama.tap_layers`). At slot
t the head reads x_{t+1} and s_t, a state of position t: for committed positions s_t = fc([a_t ; b_t ;
c_t]), for drafted ones the head's own output at the slot before (EAGLE-3 feeds its pre-norm output back,
skipping fc). The layer::

    r = s_t (or hidden_norm(s_t) where the config says ``norm_before_residual``)
    h = r + o_proj(attention(q, k, v of [input_layernorm(embed(x_{t+1})) ; hidden_norm(s_t)]))
    out = h + mlp(post_attention_layernorm(h))        # fed back as s_{t+1} when drafting on
    logits = lm_head(norm(out))                       # over the draft vocabulary

The head runs in float32 torch (unpacked, so a reference written from this description matches it bit for
bit), or beside a target on the native kernels with its matrices on them (:class:`PublishedHead`). Its draft
distributions cover the draft vocabulary; :meth:`LearnedHead.full_q` puts them on the target's vocabulary
with zeros elsewhere — exactly the distribution each draft token was sampled from, so rejection sampling
stays exact (a target token outside the draft vocabulary is never drafted: its q is 0, and the verifier's
residual max(p − q, 0) gives it its full p).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from verispec.drafting.learned.eagle import EagleHead, TokenRows
from verispec.drafting.learned.eagle_drafter import EagleDrafter
from verispec.drafting.learned.head import LearnedHead, native_target, target_head_rows
from verispec.errors import UsageError
from verispec.files import atomic_path, atomic_write
from verispec.inputs import is_int, parse_json
from verispec.models.base import LanguageModel
from verispec.models.kv_cache import RowsBeside
from verispec.models.llama import _MLP, Llama, _Attention, _Linear, _RMSNorm, attention_inputs
from verispec.models.llama_config import LlamaConfig
from verispec.options import SamplingParams

__all__ = [
    "AUX_LAYERS_KEY",
    "SAVED_DTYPE",
    "WEIGHTS",
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Head",
    "PublishedHead",
    "aux_layers",
    "check_layout",
    "layer_config",
    "published_config",
    "published_files",
    "read_published",
]

WEIGHTS = "model.safetensors"  # the weights' file in a published head's directory
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"  # config.json's target layers read
SAVED_DTYPE = torch.float16  # the weights of the heads verispec trains, as written
_MAPPING = ("d2t", "t2d", "embed_tokens.weight")  # tensors beside the head's modules


def published_files(path: str | Path) -> tuple[Path, Path]:
    """(the weights, its config.json) of a published head: ``path`` a directory holding both, or the
    safetensors file with config.json beside it. UsageError, one line, for anything else (a pickled
    ``pytorch_model.bin`` among them: not read)."""
    path = Path(path).expanduser()
    weights = path / WEIGHTS if path.is_dir() else path
    if weights.suffix == ".bin" or (not weights.exists() and (weights.parent / "pytorch_model.bin").exists()):
        raise UsageError(
            f"{path}: pytorch_model.bin is a pickle, not read by verispec: convert it to model.safetensors "
            "(safetensors.torch.save_file of its state dict) and give that"
        )
    if not weights.is_file():
        raise UsageError(f"no published head at {path}: give its model.safetensors (config.json beside it)")
    config = weights.parent / "config.json"
    if not config.is_file():
        raise UsageError(f"{weights}: no config.json beside it (the head's published config)")
    return weights, config


def read_published(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, Tensor]]:
    """(the weights' path, the config, the tensors) of a published head (:func:`published_files`)."""
    from safetensors import SafetensorError, safe_open

    weights, config_path = published_files(path)
    try:
        config = parse_json(config_path.read_bytes())
    except (UsageError, OSError) as err:
        raise UsageError(f"{config_path}: {err}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{config_path}: not a JSON object")
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UsageError(f"{weights} is not a readable safetensors file: {first}") from None
    return weights, config, tensors


def layer_config(config: dict[str, Any], target: Llama, where: Path, layers: int) -> LlamaConfig:
    """The decoder layers' config of a published head (its config.json ``config``; ``layers`` of them) beside
    ``target``: its heads, widths, epsilon and RoPE, the target's context. UsageError, one line, for a
    hidden size (or ``target_hidden_size``) or vocabulary other than the target's, or a config not of a Llama
    layer."""
    hidden = target.config.hidden_size
    for key in ("hidden_size", "target_hidden_size"):
        if key in config and config[key] != hidden:
            raise UsageError(
                f"{where}: the head's {key} is {config[key]!r}, the target's hidden size {hidden}"
            )
    if config.get("vocab_size") != target.vocab_size:
        raise UsageError(
            f"{where}: the head's vocab_size is {config.get('vocab_size')!r}, the target's vocabulary "
            f"{target.vocab_size}"
        )
    own = {**config, "model_type": "llama", "architectures": [], "num_hidden_layers": layers}
    try:
        layer = LlamaConfig.from_hf_config(own)
    except (UsageError, TypeError, ValueError) as err:
        raise UsageError(f"{where}: {err}") from None
    return dataclasses.replace(layer, max_position_embeddings=target.max_context, sliding_window=None)


def check_layout(
    tensors: dict[str, Tensor],
    shapes: dict[str, tuple[int, ...]],
    optional: dict[str, tuple[int, ...]],
    where: Path,
    layout: str,
    hint: str = "",
) -> None:
    """UsageError naming the first tensor of ``layout`` (required ``shapes``, ``optional`` ones) missing from
    ``tensors`` (with ``hint``), not of it, or of another shape."""
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise UsageError(f"{where} has no tensor {missing[0]}{hint}: not the published {layout} layout")
    unknown = sorted(set(tensors) - set(shapes) - set(optional))
    if unknown:
        raise UsageError(f"{where} holds {unknown[0]}, not a tensor of the published {layout} layout")
    for name, tensor in tensors.items():
        shape = shapes.get(name, optional.get(name))
        if tuple(tensor.shape) != shape:
            raise UsageError(f"{where}: {name} has shape {tuple(tensor.shape)}, {shape} beside this target")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A published head's config as it fits a target: its decoder layer's (a one-layer
    :class:`LlamaConfig`: heads, widths, norms' epsilon, its own RoPE; the target's context), the draft
    vocabulary's size, the target layers whose inputs it reads (ascending) and whether the residual
    stream starts from the normed state."""

    layer: LlamaConfig
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False

    @classmethod
    def of(cls, config: dict[str, Any], target: Llama, where: Path) -> Eagle3Config:
        """The config.json ``config`` of the head at ``where`` beside ``target``; UsageError, one line, where
        it does not fit (hidden size, vocabulary, layers past the target's)."""
        layer = layer_config(config, target, where, 1)
        nested = config.get("eagle_config")
        eagle: dict[str, Any] = nested if isinstance(nested, dict) else {}
        ids = config.get(AUX_LAYERS_KEY, eagle.get(AUX_LAYERS_KEY))
        n = target.config.num_layers
        ids = _published_aux_layers(n) if ids is None else ids
        if (
            not isinstance(ids, list | tuple)
            or len(ids) != 3
            or any(not is_int(i) or not 0 <= i < n for i in ids)
            or len(set(ids)) != 3
        ):
            raise UsageError(
                f"{where}: the head reads target layers {ids!r}; this target has {n} layers (three "
                f"distinct ids in [0, {n}) are needed)"
            )
        draft = config.get("draft_vocab_size", target.vocab_size)
        if not is_int(draft) or not 0 < draft <= target.vocab_size:
            raise UsageError(f"{where}: draft_vocab_size {draft!r} is not in [1, {target.vocab_size}]")
        return cls(layer, draft, tuple(sorted(ids)), bool(config.get("norm_before_residual", False)))


def _published_aux_layers(count: int) -> tuple[int, int, int]:
    """The target layers a head reads when its config names none, for a target of ``count`` layers
    (EAGLE's and vLLM's default)."""
    return (2, count // 2, count - 3)


def aux_layers(count: int) -> tuple[int, ...]:
    """The target layers a new head reads beside a target of ``count`` layers: the published default where
    its three are distinct, else the first, middle and last (a small target's); UsageError below three."""
    if count < 3:
        raise UsageError(f"an EAGLE-3 head reads three of the target's layers: this target has {count}")
    default = _published_aux_layers(count)
    return tuple(sorted(default)) if len(set(default)) == 3 else (0, count // 2, count - 1)


def published_config(
    layer: LlamaConfig,
    vocab_size: int,
    draft_vocab_size: int,
    aux: tuple[int, ...],
    norm_before_residual: bool = False,
) -> dict[str, Any]:
    """The config.json of a head of decoder layer ``layer`` over a target vocabulary of ``vocab_size`` with a
    draft vocabulary of ``draft_vocab_size``, reading the inputs of target layers ``aux``: the keys of the
    authors' and vLLM's / SGLang's ``LlamaForCausalLMEagle3`` (the layers read at the top and in
    ``eagle_config``, where either reader looks)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "max_position_embeddings": layer.max_position_embeddings,
        "attention_bias": layer.attention_bias,
        "mlp_bias": layer.mlp_bias,
        "tie_word_embeddings": False,
        "torch_dtype": str(SAVED_DTYPE).removeprefix("torch."),
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "norm_before_residual": norm_before_residual,
        AUX_LAYERS_KEY: list(aux),
        "eagle_config": {AUX_LAYERS_KEY: list(aux)},
    }


class _Midlayer(nn.Module):
    """The head's decoder layer, named as published (``midlayer.*``): its attention reads 2H-wide inputs."""

    def __init__(self, config: LlamaConfig, device: Any) -> None:
        super().__init__()
        h, eps, f32 = config.hidden_size, config.rms_norm_eps, torch.float32
        self.input_layernorm = _RMSNorm(h, eps, device, f32)
        self.hidden_norm = _RMSNorm(h, eps, device, f32)
        self.self_attn = _Attention(config, device, f32)
        q, k, v = self.self_attn.qkv_sizes
        bias = config.attention_bias
        self.self_attn.q_proj = _Linear(2 * h, q, bias, device, f32)
        self.self_attn.k_proj = _Linear(2 * h, k, bias, device, f32)
        self.self_attn.v_proj = _Linear(2 * h, v, bias, device, f32)
        self.post_attention_layernorm = _RMSNorm(h, eps, device, f32)
        self.mlp = _MLP(config, device, f32)


class PublishedHead(EagleHead):
    """What the published heads share: an :class:`EagleHead`'s interface over modules of their own (their
    constructors build them; EagleHead's is not called), in float32 torch, unpacked — the numerics of a
    reference written from the papers — unless ``load``'s ``fast`` finds the target on the native kernels:
    then every matrix of the head on those kernels in :data:`DRAFT_FORMAT`, each linear alone (attention
    stays in torch over a float32 cache), another drafter than the float32 one, every draft distribution
    computed from its own logits. Each drafter's cache is its own (rows never drafted together)."""

    def optimize_for_cpu(self, native: bool = False, min_weight_elements: int = 2**17) -> bool:
        """On the native kernels with ``native`` (see the class); else unpacked (returns False)."""
        return native and super().optimize_for_cpu(native=True)

    def pack_native(self) -> None:
        """Each linear on the native kernels (not EagleHead's stack: the layers are not a Llama's)."""
        LearnedHead.pack_native(self)

    @property
    def rows_alone(self) -> bool:
        return False


class Eagle3Head(PublishedHead):
    """A published EAGLE-3 head (module docstring) beside its target, drafting as an :class:`EagleHead`
    does (the same drafter, :class:`Eagle3Drafter`): its "features" are the states s_t, the committed ones
    fused from the target's three layers by :meth:`fuse`; :meth:`forward` returns the layer's pre-norm
    output and :meth:`logits` normalises it. Read with :meth:`load`."""

    kind = "eagle3"

    def __init__(
        self, target: LanguageModel, config: Eagle3Config, tensors: dict[str, Tensor], where: Path
    ) -> None:
        target = native_target(target)
        _check_tensors(tensors, config, target, where)
        ids, rows = _draft_vocabulary(tensors, config, target.vocab_size, where)
        LearnedHead.__init__(self, target, ids, {"published": str(where)}, head_rows=rows)
        device, h = target.device, target.config.hidden_size
        self.config = config.layer
        self.aux_layers = config.aux_layers
        self.norm_before_residual = config.norm_before_residual
        self.fc = _Linear(3 * h, h, False, device, torch.float32)
        self.midlayer = _Midlayer(config.layer, device)
        self.norm = _RMSNorm(h, config.layer.rms_norm_eps, device, torch.float32)
        self.embed = TokenRows.of(target, self.draft_vocab, tensors.get("embed_tokens.weight"))
        self.inv_freq = nn.Buffer(config.layer.rope_inv_freq().to(device), persistent=False)
        self._stack = None
        self._draft_head = None
        self._rows = RowsBeside()
        with torch.no_grad():
            for name, param in self.state_dict().items():
                param.copy_(tensors[name])
        target.tap_layers(config.aux_layers)

    @classmethod
    def load(cls, path: str | Path, target: LanguageModel, target_label: str = "", fast: bool = False):
        """The published head at ``path`` (a directory with config.json and model.safetensors, or the
        safetensors file) for ``target``, which from then on returns the inputs of the layers the head reads
        (:meth:`~verispec.models.llama.Llama.tap_layers`); ``fast``: on the native kernels beside a target
        on them (:class:`PublishedHead`). UsageError, one line, for a head that does not fit the target or
        misses a tensor."""
        weights, config, tensors = read_published(path)
        model = native_target(target)
        head = cls(model, Eagle3Config.of(config, model, weights), tensors, weights)
        head.optimize_for_cpu(native=fast and model.on_native_kernels)
        return head

    @classmethod
    def create(
        cls,
        target: Llama,
        draft_vocab: Tensor,
        generator: torch.Generator,
        metadata: dict[str, Any],
        *shape: int,
    ) -> Eagle3Head:
        """A fresh head to train beside ``target`` (:mod:`verispec.training.eagle3`): one Llama decoder layer
        of the target's widths reading the inputs of its layers ``shape`` (default :func:`aux_layers`), over
        ``draft_vocab`` [Vd] (target ids, ascending); fc and the layer's matrices drawn N(0, 0.02²) from
        ``generator``, unit norms but the output norm (the target's final one), ``lm_head`` the target's own
        rows of the draft vocabulary — a trainable parameter, as the authors train it."""
        c, ids = target.config, torch.as_tensor(draft_vocab, dtype=torch.long)
        layer = LlamaConfig(
            vocab_size=target.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=1,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,
            max_position_embeddings=target.max_context,
        )
        aux = tuple(shape) or aux_layers(c.num_layers)
        where = Path("a new eagle3 head")
        config = Eagle3Config.of(published_config(layer, target.vocab_size, len(ids), aux), target, where)
        shapes, _ = _layout(config, target)
        tensors = {name: torch.ones(size) for name, size in shapes.items()}
        tensors |= _vocabulary_tensors(ids, target.vocab_size)
        tensors["lm_head.weight"] = target_head_rows(target, ids)  # the target's own rows
        head = cls(target, config, tensors, where)
        head.metadata = dict(metadata)
        head.initialise(target, generator)
        rows = head.head_weight.clone()
        del head.head_weight  # a buffer of every other head: a parameter of this one
        head.register_parameter("head_weight", nn.Parameter(rows))
        return head

    def save(self, path: str | Path) -> Path:
        """Write the head in the published layout, atomically: the weights at ``path`` (a
        ``model.safetensors``, in :data:`SAVED_DTYPE`, ``d2t`` and ``t2d`` from the draft vocabulary; the
        training record in its metadata) and ``config.json`` beside it — what ``--drafter eagle3
        --drafter-path DIR``, vLLM and SGLang read."""
        from safetensors.torch import save_file

        path = Path(path)
        if self.cpu_precision is not None:
            raise UsageError("a head optimized for CPU cannot be saved: save it before optimize_for_cpu")
        tensors = {
            name: t.detach().to("cpu", SAVED_DTYPE).contiguous()
            for name, t in self.state_dict().items()
            if name != "head_weight"
        }
        tensors["lm_head.weight"] = self.head_weight.detach().to("cpu", SAVED_DTYPE).contiguous()
        tensors |= _vocabulary_tensors(self.draft_vocab.cpu(), self.vocab_size)
        metadata = {"format": "pt", "verispec": json.dumps(self.metadata)}
        config = published_config(
            self.config, self.vocab_size, self.draft_vocab_size, self.aux_layers, self.norm_before_residual
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata=metadata)
        atomic_write(path.parent / "config.json", json.dumps(config, indent=2) + "\n")
        return path

    @classmethod
    def from_file(
        cls,
        path: Path,
        metadata: dict[str, str],
        tensors: dict[str, Tensor],
        target: LanguageModel,
        target_label: str,
        fast: bool,
    ) -> Eagle3Head:
        """Refused in one line: an EAGLE-3 head is read in its published layout (:meth:`load`), never from a
        verispec drafter file."""
        raise UsageError(
            f"{path}: an eagle3 head is read in the published layout (a directory with model.safetensors and "
            "config.json: --drafter eagle3 --drafter-path DIR), not from a verispec drafter file"
        )

    def fuse(self, states: Tensor) -> Tensor:
        """The target's tapped states [T, 3H] (its layers' inputs, ascending) → s [T, H] through fc."""
        return self.fc(states.float())

    def forward(
        self, tokens: Tensor, features: Tensor, positions: Tensor, cache: Any, mask: Tensor | None = None
    ) -> Tensor:
        """tokens: [B, T] int64, x_{t+1} at each slot t; features: [B, T, H], s_t (fused or fed back);
        positions: [B, T] int64. Returns the layer's output [B, T, H] (before the norm), appending T slots to
        ``cache``; mask as :meth:`EagleHead.forward`'s."""
        layer = self.midlayer
        embedded = layer.input_layernorm(self.embed(tokens))  # [B, T, H]
        state = features.float()  # [B, T, H]
        normed = layer.hidden_norm(state)
        residual = normed if self.norm_before_residual else state
        start, end, cos, sin, mask = attention_inputs(state, positions, cache, self.inv_freq, mask)
        x = torch.cat((embedded, normed), dim=-1)  # [B, T, 2H]
        h = residual + layer.self_attn(x, cos, sin, cache.keys[0], cache.values[0], start, mask)
        cache._length = end
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, features: Tensor) -> Tensor:
        """The layer's outputs [..., H] → draft logits [..., Vd] float32: lm_head(norm(·))."""
        return super().logits(self.norm(features.float()))


def _vocabulary_tensors(ids: Tensor, vocab_size: int) -> dict[str, Tensor]:
    """The published mapping of draft vocabulary ``ids`` [Vd] (target ids, ascending) in a target vocabulary
    of ``vocab_size``: ``d2t`` [Vd] (draft id d → target id d + d2t[d]) and ``t2d`` [V] bool."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[ids] = True
    return {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}


Shapes = dict[str, tuple[int, ...]]


def _layout(config: Eagle3Config, target: Llama) -> tuple[Shapes, Shapes]:
    """The published layout's tensors beside ``target``: (the required ones' shapes, the optional ones')."""
    c, h, vocab = config.layer, target.config.hidden_size, target.vocab_size
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }
    if c.attention_bias:
        shapes |= {f"midlayer.self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
    if c.attention_out_bias:
        shapes["midlayer.self_attn.o_proj.bias"] = (h,)
    if c.mlp_bias:
        shapes |= {
            f"midlayer.mlp.{p}_proj.bias": (n,) for p, n in (("gate", inter), ("up", inter), ("down", h))
        }
    optional = {"d2t": (config.draft_vocab_size,), "t2d": (vocab,), "embed_tokens.weight": (vocab, h)}
    if config.draft_vocab_size < vocab:
        shapes["d2t"] = optional["d2t"]
    return shapes, optional


def _check_tensors(tensors: dict[str, Tensor], config: Eagle3Config, target: Llama, where: Path) -> None:
    """UsageError naming the first tensor of the published layout missing, unknown or of another shape."""
    shapes, optional = _layout(config, target)
    other = "layers.0.self_attn.q_proj.weight" in tensors
    hint = " (an EAGLE-1/2 head's layers.0.*: --drafter eagle2)" if other else ""
    check_layout(tensors, shapes, optional, where, "EAGLE-3", hint)


def _draft_vocabulary(
    tensors: dict[str, Tensor], config: Eagle3Config, vocab: int, where: Path
) -> tuple[Tensor, Tensor]:
    """The draft vocabulary's target ids, ascending [Vd] int64, and the lm_head rows in that order [Vd, H]
    float32: draft id d is target id d + d2t[d] (the identity without d2t); t2d, where given, must mark the
    same ids. UsageError for ids out of the vocabulary or repeated."""
    draft = config.draft_vocab_size
    offsets = tensors.get("d2t")
    ids = torch.arange(draft) + (0 if offsets is None else offsets.long())  # [Vd]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft:
        raise UsageError(f"{where}: d2t maps the draft vocabulary outside [0, {vocab}) or twice onto one id")
    marked = tensors.get("t2d")
    if marked is not None and (
        marked.dtype != torch.bool or not torch.equal(marked.nonzero()[:, 0], ids.sort().values)
    ):
        raise UsageError(f"{where}: t2d does not mark the target ids d2t maps the draft vocabulary to")
    ids, order = ids.sort()
    return ids, tensors["lm_head.weight"].float()[order]


class Eagle3Drafter(EagleDrafter):
    """:class:`EagleDrafter` with a published EAGLE-3 head: the engine hands it the target's final state and
    its tapped layers' inputs [T, 4H]; it keeps s = fc(the three inputs) [T, H] as the true features."""

    name = "eagle3"
    head: Eagle3Head

    def __init__(self, head: Eagle3Head, sampling: SamplingParams) -> None:
        super().__init__(head, sampling)

    def observe_hidden(self, hidden: Tensor) -> None:
        """hidden: [T, 4H], the target's final hidden states, then the inputs of the three layers read."""
        h = self.head.hidden_size
        if hidden.shape[-1] != 4 * h:
            raise UsageError(
                f"the eagle3 drafter reads the target's layers {list(self.head.aux_layers)}: this target "
                "returns its final hidden state alone (load the head beside it first)"
            )
        super().observe_hidden(self.head.fuse(hidden[:, h:]))
