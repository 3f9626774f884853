"""Published EAGLE-3 heads (:mod:`verispec.drafting.learned.eagle3`): random-weight heads written in the exact
layout their authors publish (tensor names, shapes and dtypes, config.json) beside tiny random targets — a
float32 Llama, the same on the native kernels, a Qwen2 and a Llama saved by transformers — checked against a
reference forward written here from the paper's description, then for exactness in the engine, and each
refusal in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fakes import LetterTokenizer
from test_eagle import tiny_target as eagle_target
from verispec import cli
from verispec.api import Speculator
from verispec.drafting.learned.eagle3 import Eagle3Drafter, Eagle3Head
from verispec.drafting.registry import DRAFTERS, check_choice
from verispec.drafting.tree import TreeShape
from verispec.errors import UsageError
from verispec.models.llama import Llama
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 64, 32, 8, 40
GREEDY = SamplingParams(temperature=0)
PROMPTS = ("abc", "hello", "qqqzzz", "the", "mnopqrs")


def tiny_target(native: bool = False, seed: int = 0) -> Llama:
    """A random 8-layer Llama (default layers read: 2, 4, 5) with peaked next-token distributions; in float16
    on the native kernels with ``native``."""
    model = eagle_target(seed, VOCAB, LAYERS)
    if native:
        assert model.optimize_for_cpu(precision="fp16", min_weight_elements=0) and model.on_native_kernels
    return model


def head_config(**changes) -> dict:
    """A published head's config.json (EAGLE-3 Llama 3.1 8B's keys) for the tiny targets."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": 40,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
    }
    return {**config, **changes}


def head_tensors(config: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random tensors of the published layout for ``config``: matrices of scale 1/sqrt(fan-in), norms near
    one, ``d2t`` (int64) and ``t2d`` (bool) of a random draft vocabulary, ascending as EAGLE-3 writes it."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab, draft = (
        config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "draft_vocab_size")
    )
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (draft, h),
    }
    tensors = {
        name: (torch.randn(shape, generator=g) * 2 / math.sqrt(shape[1])).to(dtype)
        for name, shape in shapes.items()
    }
    for name in (
        "midlayer.input_layernorm",
        "midlayer.hidden_norm",
        "midlayer.post_attention_layernorm",
        "norm",
    ):
        tensors[f"{name}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    used = torch.randperm(vocab, generator=g)[:draft].sort().values  # target ids, ascending
    tensors["d2t"] = used - torch.arange(draft)  # int64
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    tensors["t2d"][used] = True
    return tensors


def write_head(
    directory: Path, config: dict | None = None, tensors: dict | None = None, seed: int = 0
) -> Path:
    """A head directory as published: config.json and model.safetensors (random EAGLE-3 tensors or, for an
    EAGLE-1/2 config, EAGLE-1/2 ones, unless given)."""
    config = head_config() if config is None else config
    if tensors is None:
        tensors = head_tensors(config, seed) if "draft_vocab_size" in config else eagle2_tensors(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


# ---------------------------------------------------------------- the reference, from the paper


def reference_states(target: Llama, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's features EAGLE-3 fuses, computed apart from the runners' taps: the residual stream
    entering each of ``layers``, for every position of ``ids``, by running the target's decoder layers one at
    a time ([len(ids), 3H], low to high)."""
    h = target.embed(torch.tensor([ids])).float()  # [1, T, H]
    n = len(ids)
    d = target.config.head_dim
    inv = 1.0 / (target.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    angles = torch.arange(n)[:, None].float() * inv
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    states = []
    for i, layer in enumerate(target.model.layers):
        if i in layers:
            states.append(h[0])
        x = layer.input_layernorm(h)
        h = h + _attention(layer.self_attn, x, cos, sin, torch.ones(n, n, dtype=torch.bool).tril())
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return torch.cat(states, -1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _attention(attn, x, cos, sin, mask) -> torch.Tensor:
    """The target's own attention modules' weights, applied here (x [1, T, H], mask [T, T])."""
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return attn.o_proj(_sdpa(q, k, v, cos, sin, mask, attn.num_heads, attn.num_kv_heads)[None])


def _sdpa(q, k, v, cos, sin, mask, heads: int, kv_heads: int) -> torch.Tensor:
    """Grouped-query attention of q [1, T, heads·d] over k, v [1, S, kv_heads·d] (cos, sin of the new
    positions [T, d] and of all [S, d]) → [T, heads·d]."""
    t, s, d = q.shape[1], k.shape[1], q.shape[-1] // heads
    qh = _rope(q.view(t, heads, d).transpose(0, 1), cos[-t:], sin[-t:])
    kh = _rope(k.view(s, kv_heads, d).transpose(0, 1), cos, sin)
    vh = v.view(s, kv_heads, d).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        qh[None], kh[None], vh[None], attn_mask=mask, enable_gqa=heads != kv_heads
    )
    return out[0].transpose(0, 1).reshape(t, heads * d)


class Reference:
    """EAGLE-3's draft head from the paper and the published layout, in plain float32 torch: s_t = fc(the
    three features) for committed positions; at slot t, [norm_in(embed(x_{t+1})) ; norm_h(s_t)] through one
    attention (q, k, v over 2H) added to s_t, then the MLP; its output normalised through lm_head drafts the
    next token, and the output itself is the next step's s."""

    def __init__(self, tensors: dict[str, torch.Tensor], config: dict, embedding: torch.Tensor) -> None:
        self.w = {k: v.float() for k, v in tensors.items()}
        self.config, self.embedding = config, embedding.float()
        self.ids = torch.arange(config["draft_vocab_size"]) + tensors["d2t"]  # draft id → target id
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.eps = config["rms_norm_eps"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        d = config["hidden_size"] // self.heads
        self.inv = 1.0 / (
            config.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        )

    def step(self, tokens: list[int], states: torch.Tensor, start: int) -> torch.Tensor:
        """Slots start.. with tokens x_{t+1} [T] and states s_t [T, H] (causal over all slots so far) → the
        layer's outputs [T, H]."""
        w, eps = self.w, self.eps
        t = len(tokens)
        emb = _rms(self.embedding[torch.tensor(tokens)], w["midlayer.input_layernorm.weight"], eps)
        normed = _rms(states, w["midlayer.hidden_norm.weight"], eps)
        x = torch.cat((emb, normed), -1)[None]  # [1, T, 2H]
        self.keys.append(F.linear(x, w["midlayer.self_attn.k_proj.weight"]))
        self.values.append(F.linear(x, w["midlayer.self_attn.v_proj.weight"]))
        q = F.linear(x, w["midlayer.self_attn.q_proj.weight"])
        angles = torch.arange(start + t)[:, None].float() * self.inv
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        mask = torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start)
        k, v = torch.cat(self.keys, 1), torch.cat(self.values, 1)
        attn = _sdpa(q, k, v, cos, sin, mask if t > 1 else None, self.heads, self.kv_heads)
        h = states + F.linear(attn[None], w["midlayer.self_attn.o_proj.weight"])[0]
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = (
            F.linear(m, w["midlayer.mlp.gate_proj.weight"]),
            F.linear(m, w["midlayer.mlp.up_proj.weight"]),
        )
        return h + F.linear(F.silu(gate) * up, w["midlayer.mlp.down_proj.weight"])

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] of layer outputs [..., H], in draft-id order."""
        return F.linear(_rms(out, self.w["norm.weight"], self.eps), self.w["lm_head.weight"])

    def greedy(
        self, context: list[int], features: torch.Tensor, k: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The greedy chain of k target ids after ``context`` (features [len - 1, 3H] of its positions) and
        each step's draft logits."""
        n = len(context) - 1
        out = self.step(context[1:], F.linear(features, self.w["fc.weight"]), 0)[-1:]  # [1, H]
        drafts, logits = [], []
        for i in range(k):
            logits.append(self.logits(out)[0])
            drafts.append(int(self.ids[int(logits[-1].argmax())]))
            if i < k - 1:
                out = self.step(drafts[-1:], out, n + i)
        return drafts, logits


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def target() -> Llama:
    return tiny_target()


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    return write_head(tmp_path_factory.mktemp("head"))


def test_taps_are_the_layers_inputs_and_change_nothing_else(tmp_path):
    """The tapped states are the residual stream entering each layer (computed apart), after the final state,
    which with the logits is bit for bit the untapped forward's, on the float path and the native kernels
    (a forward in parts), alone and in a batch's rows."""
    ids = [5, 9, 2, 33, 7, 1, 60, 12]
    tokens, positions = torch.tensor([ids]), torch.arange(len(ids))[None]
    for native in (False, True):
        plain, tapped = tiny_target(native), tiny_target(native)
        tapped.tap_layers([5, 2, 4])
        a = plain.forward_hidden(tokens, positions, plain.new_cache())[0]
        b = tapped.forward_hidden(tokens, positions, tapped.new_cache())[0]
        assert b.shape == (len(ids), 4 * HIDDEN)
        assert torch.equal(a, b[:, :HIDDEN]) and torch.equal(plain.logits(a), tapped.logits(b))
        reference = reference_states(tiny_target(), ids, (2, 4, 5))
        tolerance = {"rtol": 2e-2, "atol": 0.1} if native else {"atol": 1e-5}  # float16 weights natively
        assert torch.allclose(b[:, HIDDEN:].float(), reference, **tolerance)
        if native:  # a batch's rows: each row's states its own forward's
            from verispec.models.base import RowInput

            rows = tapped.new_cache_rows(2)
            out = tapped.forward_rows(
                [
                    RowInput(rows[i], tokens[0, : 5 + i], positions[0, : 5 + i], None, True, True)
                    for i in range(2)
                ]
            )
            assert torch.equal(out[1][1], b[:6]) and torch.equal(out[0][1], b[:5])


def test_taps_refused_in_one_line(target):
    model = tiny_target()
    with pytest.raises(UsageError, match=r"distinct integers in \[0, 8\)"):
        model.tap_layers([2, 8, 4])
    model.tap_layers([1, 2, 3])
    with pytest.raises(UsageError, match="already returns the inputs of layers"):
        model.tap_layers([2, 4, 5])


def test_head_equals_the_reference_bit_for_bit(head_dir):
    """The loaded head's forward, logits and chained greedy drafts == the reference's, bit for bit (bfloat16
    weights read as float32), from features the target's taps give."""
    model = tiny_target()
    head = Eagle3Head.load(head_dir, model)
    config = json.loads((head_dir / "config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(head_dir / "model.safetensors")
    assert head.aux_layers == (2, 4, 5) and model.taps == (2, 4, 5)
    context = [3, 14, 15, 9, 2, 6, 53, 58, 9]
    states = model.forward_hidden(
        torch.tensor([context]), torch.arange(len(context))[None], model.new_cache()
    )[0]
    features = states[:-1, HIDDEN:]  # [n, 3H]: the committed positions' taps
    assert torch.allclose(features, reference_states(model, context[:-1], (2, 4, 5)), rtol=1e-4, atol=1e-4)
    ref = Reference(tensors, config, model.model.embed_tokens.weight)
    want, want_logits = ref.greedy(context, features, 4)
    # the head's own calls, shaped as the drafter makes them
    cache = head.new_cache()
    n = len(context) - 1
    out = head(torch.tensor([context[1:]]), head.fuse(features)[None], torch.arange(n)[None], cache)[0]
    assert torch.equal(
        out,
        Reference(tensors, config, model.model.embed_tokens.weight).step(
            context[1:], F.linear(features, ref.w["fc.weight"]), 0
        ),
    )
    order = torch.argsort(ref.ids)  # the head's draft vocabulary is ascending: the same order here
    assert torch.equal(head.draft_vocab, ref.ids[order])
    assert torch.equal(head.logits(out[-1:])[0], want_logits[0][order])
    drafter = Eagle3Drafter(head, GREEDY)
    drafter.begin(context)
    drafter.observe_hidden(states[:-1])
    assert drafter.propose(context, 4, torch.Generator()).tokens.tolist() == want


def test_q_is_zero_outside_the_draft_vocabulary(target, head_dir):
    """Sampled drafts: q is the sampling transform of the head's logits on the draft vocabulary and 0 on every
    other target token (exact for rejection sampling: a token never drafted has q = 0, the residual gives it
    its whole p)."""
    model = tiny_target()
    head = Eagle3Head.load(head_dir, model)
    context = [3, 14, 15, 9, 2, 6]
    sampling = SamplingParams(temperature=0.8, top_k=20)
    states = model.forward_hidden(
        torch.tensor([context]), torch.arange(len(context))[None], model.new_cache()
    )[0]
    drafter = Eagle3Drafter(head, sampling)
    drafter.begin(context)
    drafter.observe_hidden(states[:-1])
    proposal = drafter.propose(context, 3, torch.Generator().manual_seed(0))
    assert proposal.q is not None and proposal.q.shape == (3, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[head.draft_vocab] = False
    assert (proposal.q[:, outside] == 0).all() and torch.allclose(proposal.q.sum(-1), torch.ones(3))
    assert (proposal.q[torch.arange(3), proposal.tokens] > 0).all()
    feature = drafter.catch_up(context)
    assert feature is not None
    first = probs_from_logits(head.logits(feature[0])[0], sampling)
    assert torch.equal(proposal.q[0, head.draft_vocab], first)


def test_native_head_close_to_the_float_one(head_dir):
    """Beside a target on the native kernels the head's matrices are on them too (q8_0; float16 where a
    width does not fit its blocks), its states and logits within their rounding of the float32 head's."""
    model = tiny_target(True)
    packed, plain = Eagle3Head.load(head_dir, model, fast=True), Eagle3Head.load(head_dir, model)
    assert packed.cpu_precision == "q8_0" and plain.cpu_precision is None and not packed.rows_alone
    context = [3, 14, 15, 9, 2, 6, 53, 58, 9]
    n = len(context) - 1
    states = model.forward_hidden(torch.tensor([context]), torch.arange(n + 1)[None], model.new_cache())[0]
    outs = [
        head(torch.tensor([context[1:]]), head.fuse(states[:-1, HIDDEN:])[None], torch.arange(n)[None],
             head.new_cache())[0]
        for head in (packed, plain)
    ]  # fmt: skip
    scale = outs[1].abs().max()
    assert torch.allclose(outs[0], outs[1], atol=0.05 * scale)
    logits = [head.logits(out) for head, out in zip((packed, plain), outs, strict=True)]
    assert torch.allclose(logits[0], logits[1], atol=0.05 * logits[1].abs().max())
    spec = Speculator((model, LetterTokenizer(VOCAB)), drafter="eagle3", drafter_path=str(head_dir))
    assert spec.head is not None and spec.head.cpu_precision == "q8_0"


@pytest.mark.parametrize("native", [False, True])
def test_greedy_speculation_equals_plain_greedy(head_dir, native):
    """Speculative greedy with the head == the target's own greedy, token for token (chains K = 1, 3 and a
    tree), on the float path and the native kernels."""
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((tiny_target(native), tokenizer), drafter="none")
    spec = Speculator((tiny_target(native), tokenizer), drafter="eagle3", drafter_path=str(head_dir))
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, k=0, max_new_tokens=24, sampling=GREEDY).token_ids
        for k in (1, 3):
            result = spec.generate(prompt, k=k, max_new_tokens=24, sampling=GREEDY)
            assert result.token_ids == want, (prompt, k)
            accepted += result.stats["accepted"]
    assert accepted > 0  # the head's drafts are sometimes the target's


def test_tree_greedy_equals_plain_greedy(head_dir):
    """The head branched into a token tree (the eagle drafter's tree form): greedy == plain greedy."""
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((tiny_target(), tokenizer), drafter="none")
    shape = TreeShape.from_paths([[0], [1], [0, 0], [0, 0, 0]], name="t")
    spec = Speculator((tiny_target(), tokenizer), drafter="eagle3", drafter_path=str(head_dir), tree=shape)
    for prompt in PROMPTS[:3]:
        want = plain.generate(prompt, k=0, max_new_tokens=20, sampling=GREEDY).token_ids
        assert spec.generate(prompt, max_new_tokens=20, sampling=GREEDY).token_ids == want, prompt


def test_seeded_sampling_alone_equals_batched(head_dir):
    """A seeded sampled run gives each prompt the same tokens alone and in a continuous batch (native
    target: its rows scored together)."""
    spec = Speculator(
        (tiny_target(True), LetterTokenizer(VOCAB)), drafter="eagle3", drafter_path=str(head_dir)
    )
    sampling = SamplingParams(temperature=0.8)
    seeds = list(range(len(PROMPTS)))
    batch = spec.generate_batch(
        list(PROMPTS), k=3, max_new_tokens=30, sampling=sampling, slots=3, seeds=seeds
    )
    for prompt, seed, result in zip(PROMPTS, seeds, batch, strict=True):
        alone = spec.generate(prompt, k=3, max_new_tokens=30, sampling=sampling.with_seed(seed))
        assert result.token_ids == alone.token_ids, prompt


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_transformers_targets(tmp_path, kind):
    """Beside a Llama and a Qwen2 saved by transformers (layers read given in the config): speculative greedy
    == plain greedy."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    hf = (
        LlamaForCausalLM(HFLlamaConfig(**common))
        if kind == "llama"
        else Qwen2ForCausalLM(Qwen2Config(**common))
    )
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "target")
    config = head_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    head = write_head(tmp_path / "head", config)
    model = Llama.from_pretrained(tmp_path / "target")
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((model, tokenizer), drafter="none")
    want = {p: plain.generate(p, k=0, max_new_tokens=16, sampling=GREEDY).token_ids for p in PROMPTS[:3]}
    spec = Speculator((model, tokenizer), drafter="eagle3", drafter_path=str(head / "model.safetensors"))
    assert model.taps == (0, 1, 3)
    for prompt in PROMPTS[:3]:
        assert spec.generate(prompt, k=3, max_new_tokens=16, sampling=GREEDY).token_ids == want[prompt]


def _broken(tmp_path: Path, name: str, config: dict | None = None, drop: str = "", **tensors) -> Path:
    config = head_config() if config is None else config
    written = head_tensors(config)
    written.pop(drop, None)
    written.update(tensors)
    return write_head(tmp_path / name, config, written)


def test_refusals_in_one_line(tmp_path):
    """A head that does not fit the target, a file missing a tensor or of another layout: one UsageError
    line each, before anything drafts."""
    cases = {
        "hidden": (_broken(tmp_path, "hidden", head_config(hidden_size=64)), "hidden_size is 64"),
        "target_hidden": (
            _broken(tmp_path, "th", head_config(target_hidden_size=48)),
            "target_hidden_size is 48",
        ),
        "vocab": (_broken(tmp_path, "vocab", head_config(vocab_size=128)), "vocab_size is 128"),
        "layers": (
            _broken(tmp_path, "layers", head_config(eagle_aux_hidden_state_layer_ids=[2, 4, 8])),
            "this target has 8 layers",
        ),
        "missing": (
            _broken(tmp_path, "missing", drop="midlayer.hidden_norm.weight"),
            "no tensor midlayer.hidden_norm",
        ),
        "shape": (
            _broken(tmp_path, "shape", **{"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}),
            r"fc.weight has shape \(32, 64\)",
        ),
        "d2t": (
            _broken(tmp_path, "d2t", d2t=torch.full((DRAFT_VOCAB,), VOCAB)),
            "d2t maps the draft vocabulary outside",
        ),
        "t2d": (_broken(tmp_path, "t2d", t2d=torch.ones(VOCAB, dtype=torch.bool)), "t2d does not mark"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(UsageError, match=message) as err:
            Eagle3Head.load(path, tiny_target())
        assert "\n" not in str(err.value), name
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UsageError, match="pytorch_model.bin is a pickle"):
        Eagle3Head.load(tmp_path / "bin", tiny_target())
    with pytest.raises(UsageError, match="no published head"):
        Eagle3Head.load(tmp_path / "nothing", tiny_target())
    lone = tmp_path / "lone"
    lone.mkdir()
    save_file(head_tensors(head_config()), str(lone / "weights.safetensors"))
    with pytest.raises(UsageError, match="no config.json beside it"):
        Eagle3Head.load(lone / "weights.safetensors", tiny_target())


def test_registry_and_command_line(tmp_path, head_dir, capsys):
    """One registry entry (listed with the drafters, learned, reading hidden states); a drafter file is
    required before any model loads; the CLI takes the head's file or its directory, and refuses a head that
    does not fit in one line, exit 2."""
    kind = DRAFTERS["eagle3"]
    assert kind.learned and kind.reads_target_hidden and kind.published_class() is Eagle3Head
    with pytest.raises(UsageError, match="reads a published head: give its file"):
        check_choice(None, "eagle3")
    story = Path(__file__).parent.parent.parent / "shared" / "models" / "stories260K" / "stories260K.bin"
    if not story.exists():
        pytest.skip("stories260K not present")
    common = ["generate", "--target", str(story), "--tokenizer", str(story.with_name("tok512.bin"))]
    common += ["--max-new-tokens", "4", "Once"]
    for path in (head_dir / "model.safetensors", head_dir):  # the file, or the directory as downloaded
        assert cli.main([*common, "--drafter", "eagle3", "--drafter-path", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("verispec: error:") and "hidden_size is 32" in err[0]
    assert cli.main([*common, "--drafter", "eagle", "--drafter-path", str(head_dir)]) == 2  # a file only
    assert "no such drafter file" in capsys.readouterr().err


# ---------------------------------------------------------------- EAGLE-1/2 heads (fc [H, 2H], layers.{i}.*)


def eagle2_config(**changes) -> dict:
    """A published EAGLE-1/2 head's config.json for the tiny targets (two layers: layer 0's missing norm and
    a plain one)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "torch_dtype": "float16",
    }
    return {**config, **changes}


def eagle2_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float16 tensors of the EAGLE-1/2 layout for ``config``."""
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    shapes = {"fc.weight": (h, 2 * h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {f"{p}self_attn.q_proj.weight": (h, h), f"{p}self_attn.k_proj.weight": (kv, h)}
        shapes |= {f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, h)}
        shapes |= {f"{p}mlp.gate_proj.weight": (inter, h), f"{p}mlp.up_proj.weight": (inter, h)}
        shapes[f"{p}mlp.down_proj.weight"] = (h, inter)
    tensors = {n: (torch.randn(s, generator=g) * 2 / math.sqrt(s[1])).half() for n, s in shapes.items()}
    if config.get("bias", True):
        tensors["fc.bias"] = (0.1 * torch.randn(h, generator=g)).half()
    for i in range(config["num_hidden_layers"]):
        norms = ["post_attention_layernorm"] + (["input_layernorm"] if i else [])  # layer 0: none before it
        for norm in norms:
            tensors[f"layers.{i}.{norm}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).half()
    return tensors


@pytest.fixture(scope="module")
def eagle2_dir(tmp_path_factory) -> Path:
    config = eagle2_config()
    return write_head(tmp_path_factory.mktemp("eagle2"), config, eagle2_tensors(config))


def reference_eagle2(
    tensors: dict, config: dict, target: Llama, context: list[int], k: int
) -> tuple[list[int], torch.Tensor]:
    """EAGLE-1's greedy chain written from the paper and the authors' layout: f̂ = layers(fc([embed(x) ; f]))
    (layer 0 without its input norm, no final norm), the draft the argmax of the target's head on f̂, fed back
    as the next step's feature. Returns the drafts and the f̂ over the context [len - 1, H]."""
    w = {n: t.float() for n, t in tensors.items()}
    heads, kv_heads, eps = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["rms_norm_eps"],
    )
    d = HIDDEN // heads
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    embedding = target.model.embed_tokens.weight.float()
    layers = config["num_hidden_layers"]
    keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def forward(tokens: list[int], features: torch.Tensor, start: int) -> torch.Tensor:
        t = len(tokens)
        h = F.linear(torch.cat((embedding[torch.tensor(tokens)], features), -1), w["fc.weight"], w["fc.bias"])
        angles = torch.arange(start + t)[:, None].float() * inv
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        mask = torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start) if t > 1 else None
        for i in range(layers):
            p = f"layers.{i}."
            x = (h if i == 0 else _rms(h, w[f"{p}input_layernorm.weight"], eps))[None]
            keys[i].append(F.linear(x, w[f"{p}self_attn.k_proj.weight"]))
            values[i].append(F.linear(x, w[f"{p}self_attn.v_proj.weight"]))
            q = F.linear(x, w[f"{p}self_attn.q_proj.weight"])
            attn = _sdpa(q, torch.cat(keys[i], 1), torch.cat(values[i], 1), cos, sin, mask, heads, kv_heads)
            h = h + F.linear(attn[None], w[f"{p}self_attn.o_proj.weight"])[0]
            m = _rms(h, w[f"{p}post_attention_layernorm.weight"], eps)
            gate, up = F.linear(m, w[f"{p}mlp.gate_proj.weight"]), F.linear(m, w[f"{p}mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, w[f"{p}mlp.down_proj.weight"])
        return h

    n = len(context) - 1
    final = target.forward_hidden(torch.tensor([context]), torch.arange(n + 1)[None], target.new_cache())[0]
    first = forward(context[1:], final[:-1].float(), 0)
    out, drafts = first[-1:], []
    for i in range(k):
        drafts.append(int(F.linear(out, embedding).argmax()))  # the tied target's head
        if i < k - 1:
            out = forward(drafts[-1:], out, n + i)
    return drafts, first


def test_eagle2_head_equals_the_reference(eagle2_dir):
    """A published EAGLE-1/2 head (two layers, fc with its bias, float16): the drafter's greedy chain == the
    reference's, and its f̂ over the context == the reference's, bit for bit."""
    from safetensors.torch import load_file

    from verispec.drafting.learned.eagle2 import Eagle2Drafter, Eagle2Head

    model = tiny_target()
    head = Eagle2Head.load(eagle2_dir, model)
    assert model.taps == () and head.draft_vocab_size == VOCAB
    config = json.loads((eagle2_dir / "config.json").read_text())
    tensors = load_file(eagle2_dir / "model.safetensors")
    for context in ([3, 14, 15, 9, 2, 6, 53, 58, 9], [7, 7, 1]):
        want, first = reference_eagle2(tensors, config, model, context, 4)
        n = len(context)
        final = model.forward_hidden(torch.tensor([context]), torch.arange(n)[None], model.new_cache())[0]
        out = head(torch.tensor([context[1:]]), final[None, :-1], torch.arange(n - 1)[None], head.new_cache())
        assert torch.equal(out[0], first)
        drafter = Eagle2Drafter(head, GREEDY)
        drafter.begin(context)
        drafter.observe_hidden(
            model.forward_hidden(torch.tensor([context]), torch.arange(n)[None], model.new_cache())[0][:-1]
        )
        assert drafter.propose(context, 4, torch.Generator()).tokens.tolist() == want, context


@pytest.mark.parametrize("native", [False, True])
def test_eagle2_greedy_equals_plain_greedy(eagle2_dir, native):
    tokenizer = LetterTokenizer(VOCAB)
    plain = Speculator((tiny_target(native), tokenizer), drafter="none")
    spec = Speculator((tiny_target(native), tokenizer), drafter="eagle2", drafter_path=str(eagle2_dir))
    for prompt in PROMPTS[:3]:
        want = plain.generate(prompt, k=0, max_new_tokens=20, sampling=GREEDY).token_ids
        assert spec.generate(prompt, k=3, max_new_tokens=20, sampling=GREEDY).token_ids == want, prompt


def test_eagle2_refusals_in_one_line(tmp_path, head_dir):
    from verispec.drafting.learned.eagle2 import Eagle2Head

    config = eagle2_config()
    extra = {**eagle2_tensors(config), "layers.0.input_layernorm.weight": torch.ones(HIDDEN).half()}
    no_bias = eagle2_tensors(config)
    del no_bias["fc.bias"]
    cases = {
        "eagle3": (head_dir, "no tensor fc.bias .*--drafter eagle3"),
        "extra": (write_head(tmp_path / "extra", config, extra), "holds layers.0.input_layernorm.weight"),
        "bias": (write_head(tmp_path / "bias", config, no_bias), "no tensor fc.bias"),
        "hidden": (write_head(tmp_path / "h", eagle2_config(hidden_size=64)), "hidden_size is 64"),
        "layers": (write_head(tmp_path / "l", eagle2_config(num_hidden_layers=0)), "num_hidden_layers 0"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(UsageError, match=message) as err:
            Eagle2Head.load(path, tiny_target())
        assert "\n" not in str(err.value), name
    assert Eagle2Head.load(write_head(tmp_path / "nb", eagle2_config(bias=False), None), tiny_target())


def published_head(target: Llama, directory: Path, kind: str) -> Path:
    """A random head in the published layout of ``kind`` ("eagle3": reading layers 0, N // 2 and N − 1;
    "eagle2") fitting ``target`` (its hidden size, vocabulary and attention heads): for tests of every
    drafter of the registry."""
    c = target.config
    fit = {
        "hidden_size": c.hidden_size,
        "vocab_size": target.vocab_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "intermediate_size": c.intermediate_size,
    }
    if kind == "eagle3":
        layers = [0, c.num_layers // 2, c.num_layers - 1]
        draft = target.vocab_size // 2
        config = head_config(**fit, draft_vocab_size=draft, eagle_aux_hidden_state_layer_ids=layers)
    else:
        config = eagle2_config(**fit, num_hidden_layers=1)
    return write_head(directory, config)


def test_other_hidden_readers_beside_a_tapped_target(head_dir):
    """A target tapped for an EAGLE-3 head hands wider states to every drafter that reads them: verispec's
    own eagle head and Medusa heads on that target read the final state alone, as lookahead tokens do from
    the target's own forward (greedy == plain greedy)."""
    from test_eagle import fresh_head
    from test_lookahead import random_lookahead
    from test_medusa_exit import random_medusa

    model, tokenizer = tiny_target(), LetterTokenizer(VOCAB)
    plain = Speculator((model, tokenizer), drafter="none")
    want = {p: plain.generate(p, k=0, max_new_tokens=16, sampling=GREEDY).token_ids for p in PROMPTS[:3]}
    Eagle3Head.load(head_dir, model)  # taps the target: its states [T, 4H] from now on
    vocab = torch.arange(VOCAB)
    heads = {"eagle": fresh_head(model, vocab, seed=2), "medusa": random_medusa(model, vocab)}
    heads["lookahead"] = random_lookahead(model, vocab)
    for name, head in heads.items():
        spec = Speculator(
            (model, tokenizer), drafter=name, drafter_path=str(head.save(head_dir.parent / name))
        )
        for prompt in PROMPTS[:3]:
            assert spec.generate(prompt, k=3, max_new_tokens=16, sampling=GREEDY).token_ids == want[prompt], (
                name
            )


def test_beside_a_gguf_target(tmp_path, monkeypatch):
    """Beside a Q8_0 GGUF file run in place on the native kernels (its embedding read from the file): the
    head's matrices on the kernels too, its layers read from the file's forward in parts, and speculative
    greedy == plain greedy."""
    from transformers import LlamaForCausalLM as HFLlama

    from test_gguf import tiny_llama, write_tiny_gguf
    from verispec.models.registry import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    config = tiny_llama().config
    config.num_hidden_layers = 5
    torch.manual_seed(1)
    hf = HFLlama(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model, tokenizer = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", hf, "Q8_0"), precision="auto")
    plain = Speculator((model, tokenizer), drafter="none")
    prompts = ("hello world", "the the the the", "ab")
    want = {
        p: plain.generate(p, k=0, max_new_tokens=20, sampling=GREEDY).token_ids for p in prompts
    }  # untapped
    head = published_head(model, tmp_path / "head", "eagle3")
    spec = Speculator((model, tokenizer), drafter="eagle3", drafter_path=str(head))
    assert model.taps == (0, 2, 4) and spec.head is not None and spec.head.cpu_precision == "q8_0"
    for prompt in prompts:
        assert spec.generate(prompt, k=3, max_new_tokens=20, sampling=GREEDY).token_ids == want[prompt], (
            prompt
        )
