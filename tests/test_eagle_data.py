"""The learned drafter's training data (:mod:`verispec.training.data`): the prompt set
(:mod:`verispec.training.prompts`), ``DataConfig``, and data sets built, extended and merged end to
end on a tiny random transformers Llama (with a byte-level tokenizer that has a chat template, both made
here), every stored hidden state and greedy answer checked against verispec's native Llama loaded from the
same directory."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from test_eagle import assert_usage_error, run_cli
from test_hf_adapter import save_tokenizer
from test_lookahead import needs_native
from verispec.models.registry import load_model
from verispec.training import data as data_module
from verispec.training import prompts as prompts_module
from verispec.training.data import (
    DataConfig,
    add_follow_ups,
    build_dataset,
    load_split,
    load_splits,
    merge_datasets,
)
from verispec.training.prompts import FOLLOW_UPS, chat_prompts

VOCAB = 4 + 256  # save_tokenizer's vocabulary: four special tokens, then the 256 byte symbols
EOS = {1, 3}  # </s> and <|end|> (its generation_config.json)
CONFIG = DataConfig(  # answered in float32, as the `native` fixture computes
    num_prompts=6,
    max_new_tokens=8,
    batch_size=3,
    heldout_fraction=0.25,
    seed=0,
    progress=False,
    precision="fp32",
)
HELDOUT = 2  # max(1, round(0.25 * 6))
REAL_STDLIB_PASSAGES = prompts_module._stdlib_passages


@pytest.fixture(scope="module", autouse=True)
def stdlib_passages():
    """The standard-library passages, read once: reading them parses every stdlib module (over a second per
    ``chat_prompts`` call). The same list is handed back on each call, so the prompts do not change."""
    found = REAL_STDLIB_PASSAGES()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prompts_module, "_stdlib_passages", lambda: list(found))
        yield found


# --- the prompt set -----------------------------------------------------------------------------------------


def test_chat_prompts_are_deterministic_distinct_and_counted(stdlib_passages):
    assert stdlib_passages and REAL_STDLIB_PASSAGES() == stdlib_passages  # the passages themselves are fixed
    for count in (1, 7, 200):
        prompts = chat_prompts(count, seed=3)
        assert len(prompts) == count == len(set(prompts))
        assert all(isinstance(p, str) and p.strip() for p in prompts)
        assert chat_prompts(count, seed=3) == prompts
    many = chat_prompts(200, seed=3)
    assert chat_prompts(200, seed=4) != many
    passages = set(stdlib_passages)  # the summarization requests quote a passage after a blank line
    assert any(p.split("\n\n", 1)[-1] in passages for p in many)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="count must be >= 1"):
            chat_prompts(bad)


@pytest.mark.parametrize("seed", [0, 11])
def test_a_longer_prompt_set_begins_with_a_shorter_one(seed):
    """What ``first_prompt`` relies on: prompts k.. of a longer set are new prompts, not a reshuffle."""
    longer = chat_prompts(80, seed)
    for n in (1, 9, 50, 79):
        assert chat_prompts(n, seed) == longer[:n]
    assert data_module._prompt_texts(30, 25, seed) == longer[30:55]


# --- DataConfig ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[(f, v) for f in ("num_prompts", "max_new_tokens", "batch_size") for v in (0, -1, True, 2.0)],
        *[("first_prompt", v) for v in (-1, True, False, 1.5)],
        *[("heldout_fraction", v) for v in (0, 1, 0.0, 1.0, -0.1, 1.5, float("nan"))],
        *[("seed", v) for v in (-1, True, 0.5, "0")],
        *[("turns", v) for v in (0, -1, True, 1.0)],
        *[("questions", v) for v in ("", "users", None, "Target")],
        *[("precision", v) for v in ("", "fp64", None, "Q8_0")],
    ],
)
def test_data_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field) as err:
        DataConfig(**{field: value})
    assert "\n" not in str(err.value)


def test_data_config_accepts_good_values():
    assert DataConfig(first_prompt=0).first_prompt == 0
    config = DataConfig(num_prompts=1, max_new_tokens=1, batch_size=1, heldout_fraction=0.5, first_prompt=9)
    assert (config.num_prompts, config.first_prompt, config.heldout_fraction) == (1, 9, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_prompts = 2  # type: ignore[misc]
    assert DataConfig(questions="target", turns=3).turns == 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"turns": 2}, "several turns need target-written questions"),
        ({"questions": "target", "first_prompt": 4}, "change the seed"),
    ],
)
def test_data_config_rejects_bad_combinations(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


# --- data sets of a tiny random Llama -----------------------------------------------------------------------


def save_target(directory: Path, end_boost: float, context: int = 512) -> Path:
    """A transformers-format directory: a random Llama whose vocabulary covers the tokenizer's ids, its
    ``<|end|>`` (an EOS) logit scaled by ``end_boost``, and a byte-level tokenizer with a chat template (EOS
    ids 1 and 3)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[3] *= end_boost
    model.save_pretrained(directory)
    return save_tokenizer(directory, add_bos=True)  # after the model: its generation_config.json wins


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The test target: <|end|> likelier (×4), so that some answers stop before max_new_tokens."""
    return save_target(tmp_path_factory.mktemp("target"), 4.0)


@pytest.fixture(scope="module")
def native(target):
    """(verispec's native Llama, tokenizer) of the same directory."""
    model, tokenizer = load_model(str(target))
    assert type(model).__name__ == "Llama"
    return model, tokenizer


@pytest.fixture(scope="module")
def built(target, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Two data sets of the target: prompts 0..5 ("a") and, with first_prompt = 6, prompts 6..11 ("b")."""
    root = tmp_path_factory.mktemp("data")
    later = dataclasses.replace(CONFIG, first_prompt=6)
    return {
        "a": (root / "a", build_dataset(str(target), root / "a", CONFIG)),
        "b": (root / "b", build_dataset(str(target), root / "b", later)),
    }


def sequences(directory: Path, split: str) -> list[tuple[list[int], int, torch.Tensor]]:
    """(tokens, prompt length, hidden [L, H]) of each sequence of a split, read through ``load_split``."""
    data = load_split(directory, split)
    offsets = data["offsets"].tolist()
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert len(offsets) == len(data["prompt_lengths"]) + 1
    return [
        (data["tokens"][a:b].tolist(), n, data["hidden"][a:b])
        for a, b, n in zip(offsets[:-1], offsets[1:], data["prompt_lengths"].tolist(), strict=True)
    ]


def check_against_target(native, tokens: list[int], prompt_length: int, hidden: torch.Tensor) -> bool:
    """Assert that ``hidden`` holds the target's final hidden states at ``tokens`` (float16 rounding) and that
    the sequence is a possible answer of at most max_new_tokens - 1 kept tokens; True when every answer token
    is the greedy one and the dropped last token would have been an EOS (or the length is the limit)."""
    model, _ = native
    assert 0 < prompt_length <= len(tokens)
    answer = tokens[prompt_length:]
    assert len(answer) <= CONFIG.max_new_tokens - 1 and not EOS & set(answer)
    with torch.inference_mode():
        ids = torch.tensor([tokens])  # [1, L]
        states = model.forward_hidden(ids, torch.arange(len(tokens))[None], model.new_cache(1, len(tokens)))
        logits = model.logits(states)[0]  # [L, V]
    assert hidden.dtype == torch.float16 and hidden.shape == states.shape[1:]
    torch.testing.assert_close(hidden.float(), states[0], rtol=1e-3, atol=1e-3)
    best = logits.max(-1).values  # [L]
    steps = range(prompt_length - 1, len(tokens) - 1)
    greedy = all(logits[p, tokens[p + 1]] >= best[p] - 1e-4 for p in steps)
    last = logits[-1].argmax().item()
    return greedy and (len(answer) == CONFIG.max_new_tokens - 1 or last in EOS)


def answered(native, directory: Path, first: int, count: int) -> dict[str, list[tuple[int, list[int], int]]]:
    """split → (prompt index in the data set, tokens, prompt length) of each sequence, after asserting that
    the data set answers exactly prompts first .. first + count - 1 of the prompt set, once each."""
    _, tokenizer = native
    texts = chat_prompts(first + count, CONFIG.seed)[first:]
    index = {tuple(tokenizer.encode(tokenizer.chat_prompt(t), add_bos=True)): i for i, t in enumerate(texts)}
    assert len(index) == count
    found = {
        split: [(index.get(tuple(t[:n])), t, n) for t, n, _ in sequences(directory, split)]
        for split in ("train", "heldout")
    }
    assert sorted(i for seqs in found.values() for i, _, _ in seqs if i is not None) == list(range(count))
    assert all(i is not None for seqs in found.values() for i, _, _ in seqs)
    return found


@pytest.mark.parametrize("name", ["a", "b"])
def test_build_dataset_writes_the_splits_and_their_counts(built, target, name):
    directory, meta = built[name]
    assert json.loads((directory / "meta.json").read_text()) == meta
    assert (meta["target"], meta["hidden_size"], meta["vocab_size"]) == (str(target), 32, VOCAB)
    assert meta["generation"]["first_prompt"] == (0 if name == "a" else 6)
    assert meta["generation"]["num_prompts"] == CONFIG.num_prompts
    splits = {split: sequences(directory, split) for split in ("train", "heldout")}
    assert meta["splits"] == {split: len(seqs) for split, seqs in splits.items()}
    assert meta["splits"]["heldout"] == HELDOUT
    assert meta["num_sequences"] == CONFIG.num_prompts == sum(meta["splits"].values())
    every = [seq for seqs in splits.values() for seq in seqs]
    assert meta["num_tokens"] == sum(len(t) for t, _, _ in every)
    assert 0 < meta["answer_tokens"] == sum(len(t) - n for t, n, _ in every)
    for split in ("train", "heldout"):
        data = load_split(directory, split)
        assert data["tokens"].dtype == torch.int32 and data["hidden"].dtype == torch.float16
        assert data["hidden"].shape == (data["tokens"].shape[0], 32)
        assert data["offsets"].dtype == data["prompt_lengths"].dtype == torch.int64


@pytest.mark.parametrize(("name", "first"), [("a", 0), ("b", 6)])
def test_build_dataset_stores_the_targets_answers_and_hidden_states(built, native, name, first):
    """Prompts first..first+5 answered once each; every hidden state (greedy and sampled prompts, answered in
    continuous batches of 3 rows, prompts of different lengths) is the target's; even prompts are greedy."""
    directory, _ = built[name]
    found = answered(native, directory, first, CONFIG.num_prompts)
    data = {split: sequences(directory, split) for split in found}
    prompt_lengths, answer_lengths = set(), set()
    sampled_off_greedy = 0
    for split, seqs in found.items():
        for (i, tokens, n), (_, _, hidden) in zip(seqs, data[split], strict=True):
            prompt_lengths.add(n)
            answer_lengths.add(len(tokens) - n)
            follows_greedy = check_against_target(native, tokens, n, hidden)
            if i % 2 == 0:
                assert follows_greedy, f"prompt {first + i} is greedy, but its answer is not"
            else:
                sampled_off_greedy += not follows_greedy
    assert sampled_off_greedy > 0  # the odd prompts are sampled at temperature 1
    assert len(prompt_lengths) > 2  # so the batches are padded
    assert min(answer_lengths) < CONFIG.max_new_tokens - 1 == max(answer_lengths)  # some stopped at an EOS


@needs_native
def test_a_data_set_answered_on_the_native_kernels_holds_their_hidden_states(target, built, tmp_path):
    """precision q8_0: the target as generate runs it in that format answers (the weights its drafters will
    read): every stored hidden state and greedy answer is that model's, not the float32 one's (whose hidden
    states differ by more than float16 rounding); a data set answered in float32 does not merge with it."""
    config = dataclasses.replace(CONFIG, precision="q8_0")
    meta = build_dataset(str(target), tmp_path / "q", config)
    assert meta["generation"]["precision"] == "q8_0"
    quantized = load_model(str(target), precision="q8_0")
    assert quantized[0].on_native_kernels
    found = answered(quantized, tmp_path / "q", 0, CONFIG.num_prompts)
    plain, _ = load_model(str(target), precision="fp32")
    farthest = 0.0
    for split, seqs in found.items():
        for (i, tokens, n), (_, _, hidden) in zip(seqs, sequences(tmp_path / "q", split), strict=True):
            assert check_against_target(quantized, tokens, n, hidden) or i % 2 == 1  # even prompts greedy
            with torch.inference_mode():
                ids, positions = torch.tensor([tokens]), torch.arange(len(tokens))[None]
                theirs = plain.forward_hidden(ids, positions, plain.new_cache(1, len(tokens)))[0]
            farthest = max(farthest, float((hidden.float() - theirs).abs().max()))
    assert farthest > 1e-2
    with pytest.raises(ValueError, match="different targets") as err:
        merge_datasets([built["a"][0], tmp_path / "q"], tmp_path / "merged")
    assert "fp32" in str(err.value) and "q8_0" in str(err.value) and not (tmp_path / "merged").exists()


def test_a_prompt_that_fills_the_context_is_left_out_and_said(native, capsys, tmp_path):
    """A prompt as long as the target's context cannot be answered: it is left out (None, a line on
    stderr), the others answered as alone; a split left without a sequence is refused in one line, nothing
    written."""
    from verispec.api import Speculator

    speculator = Speculator(native, drafter="none")
    short, long = [0, 5, 6, 7], [0] + [9] * native[0].max_context
    out = data_module._generate_all(speculator, [short, long, short], [False] * 3, 4, 0, CONFIG, "answers")
    assert out[1] is None and out[0] is not None and out[0][0] == out[2][0]
    assert out[0][0][:4] == short and len(out[0][0]) == 4 + 4 - 1
    err = capsys.readouterr().err
    assert "answers: 1 of 3 prompts left out" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="no sequence for the heldout split") as refused:
        data_module.write_dataset(tmp_path / "out", {"train": [out[0]], "heldout": []}, {}, 0.0)
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()


def test_merge_datasets_keeps_every_sequence(built, tmp_path):
    (a, meta_a), (b, meta_b) = built["a"], built["b"]
    meta = merge_datasets([a, str(b)], tmp_path / "merged")
    assert json.loads((tmp_path / "merged" / "meta.json").read_text()) == meta
    for split in ("train", "heldout"):
        merged = sequences(tmp_path / "merged", split)
        parts = sequences(a, split) + sequences(b, split)
        assert len(merged) == len(parts) == meta_a["splits"][split] + meta_b["splits"][split]
        for (tokens, n, hidden), (tokens_0, n_0, hidden_0) in zip(merged, parts, strict=True):
            assert (tokens, n) == (tokens_0, n_0) and torch.equal(hidden, hidden_0)
    for key in ("num_sequences", "num_tokens", "answer_tokens"):
        assert meta[key] == meta_a[key] + meta_b[key]
    assert meta["splits"] == {s: meta_a["splits"][s] + meta_b["splits"][s] for s in ("train", "heldout")}
    assert [meta[k] for k in ("target", "hidden_size", "vocab_size")] == [
        meta_a[k] for k in ("target", "hidden_size", "vocab_size")
    ]
    merged = [meta_a["generation"], meta_b["generation"]]
    assert meta["generation"] == {"merged": merged, "precision": "fp32"}


def test_a_data_set_given_twice_is_drawn_from_twice_as_often(built):
    """Training reads several data sets' sequences one after another and draws windows by length over them
    all: a data set given twice weighs twice."""
    a, b = built["a"][0], built["b"][0]
    once, twice = load_splits([a, b], "train"), load_splits([a, b, a], "train")
    first = load_split(a, "train")
    assert twice["offsets"].shape[0] - 1 == once["offsets"].shape[0] - 1 + first["offsets"].shape[0] - 1
    assert torch.equal(twice["tokens"], torch.cat([once["tokens"], first["tokens"]]))


def test_merge_datasets_bad_input(built, tmp_path, monkeypatch):
    a, b = built["a"][0], built["b"][0]
    other = tmp_path / "other"  # b, as if made by a target of another hidden size
    shutil.copytree(b, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps(meta | {"hidden_size": 64}))
    out = tmp_path / "out"
    cases = [
        ([a], "at least two data sets"),
        ([], "at least two data sets"),
        ([a, tmp_path / "absent"], "no drafter data set"),
        ([a, other], "different targets"),
    ]
    for sources, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            merge_datasets(sources, out)
        assert "\n" not in str(err.value) and not out.exists()
    # follow-ups go to each data set before merging: refused before any model is loaded
    merge_datasets([a, b], tmp_path / "merged")

    def no_model(target):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(data_module, "_load_target", no_model)
    cases = [
        (tmp_path / "merged", 1, "a merged data set"),
        (a, 0, "follow-ups must"),
        (tmp_path / "absent", 1, "no drafter data set"),
    ]
    for source, count, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            add_follow_ups(source, out, count, CONFIG)
        assert "\n" not in str(err.value) and not out.exists()


def test_add_follow_ups_continues_the_first_conversations_of_each_split(built, native, tmp_path):
    """Every old sequence, then 2 second turns per split: the old prompt and answer, a follow-up request, and
    the target's answer (greedy for even conversations, with the target's hidden states throughout)."""
    source, old_meta = built["a"]
    _, tokenizer = native
    meta = add_follow_ups(source, tmp_path / "more", 2, CONFIG)
    assert json.loads((tmp_path / "more" / "meta.json").read_text()) == meta
    assert meta["splits"] == {s: old_meta["splits"][s] + 2 for s in ("train", "heldout")}
    assert meta["num_sequences"] == old_meta["num_sequences"] + 4
    assert meta["generation"]["follow_ups"]["per_split"] == 2
    conversation = 0  # the conversations are numbered train first, then held out; even ones are greedy
    for split in ("train", "heldout"):
        old, new = sequences(source, split), sequences(tmp_path / "more", split)
        assert len(new) == len(old) + 2
        for (tokens, n, hidden), (tokens_0, n_0, hidden_0) in zip(new, old, strict=False):
            assert (tokens, n) == (tokens_0, n_0) and torch.equal(hidden, hidden_0)
        seconds = {}  # the decoded second-turn prompt → its sequence
        for tokens, n, hidden in new[len(old) :]:
            check_against_target(native, tokens, n, hidden)  # asserts the hidden states
            seconds[tokenizer.decode(tokens[:n])] = (tokens, n, hidden)
        for tokens_0, n_0, _ in old[:2]:
            question, answer = tokenizer.decode(tokens_0[:n_0]), tokenizer.decode(tokens_0[n_0:])
            matches = [key for key in seconds if any(key == question + answer + f for f in FOLLOW_UPS)]
            assert len(matches) == 1, (question, answer, list(seconds))
            tokens, n, hidden = seconds.pop(matches[0])
            assert tokens[:n_0] == tokens_0[:n_0]  # the old prompt's tokens begin the new prompt
            if conversation % 2 == 0:
                assert check_against_target(native, tokens, n, hidden)
            conversation += 1
        assert not seconds


# --- conversations the target writes itself -----------------------------------------------------------------

# seed 1: of the 14 user turns asked, 9 usable and 5 not (empty, or past the limit), in both splits
SELF_CONFIG = dataclasses.replace(CONFIG, num_prompts=8, questions="target", turns=2, seed=1)


@pytest.fixture(scope="module")
def chatty(tmp_path_factory) -> tuple[Path, tuple]:
    """A target that writes user turns of every kind (some empty, some past the 95-token limit, most between:
    SELF_CONFIG): <|end|> only ×1.5 (the test target ends a user turn at once). (directory, (native Llama,
    tokenizer))."""
    directory = save_target(tmp_path_factory.mktemp("chatty"), 1.5)
    return directory, load_model(str(directory))


@pytest.fixture(scope="module")
def self_written(chatty, tmp_path_factory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("self") / "data"
    return directory, build_dataset(str(chatty[0]), directory, SELF_CONFIG)


def test_a_user_turn_prefix_opens_a_user_turn(native):
    """The prefix the target continues is the conversation in the chat template up to where a user turn's
    text begins: whatever the user writes, the full prompt's tokens begin with it."""
    _, tokenizer = native
    for conversation in ([], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]):
        prefix = data_module._user_turn_prefix(tokenizer, conversation)
        for text in ("a question?", "x"):
            full = tokenizer.encode(
                tokenizer.chat_prompt([*conversation, {"role": "user", "content": text}]), add_bos=True
            )
            assert full[: len(prefix)] == prefix
            assert tokenizer.decode(full[len(prefix) :]) == text  # the rest: the text (and <|end|>)


def test_target_written_chats_are_the_targets_turns_and_answers(self_written, chatty):
    """Both user turns are written by the target (its chat template continued), every answer and hidden
    state is the target's, and each second turn continues a first turn of its own split."""
    directory, meta = self_written
    native = chatty[1]
    _, tokenizer = native
    assert json.loads((directory / "meta.json").read_text()) == meta
    generation = meta["generation"]
    assert generation["turns"] == 2 and "written by the target" in generation["prompts"]
    assert "first_prompt" not in generation
    splits = {split: sequences(directory, split) for split in ("train", "heldout")}
    assert meta["splits"] == {split: len(seqs) for split, seqs in splits.items()}
    assert all(meta["splits"].values()) and meta["num_sequences"] <= 2 * SELF_CONFIG.num_prompts
    greedy, second_turns = 0, 0
    for seqs in splits.values():  # the test template writes each message as <|user|> (2) text <|end|> (3)
        firsts = [(t[:n], t[n:]) for t, n, _ in seqs if t[:n].count(2) == 1]
        seconds = [t[:n] for t, n, _ in seqs if t[:n].count(2) == 3]  # question, answer, question
        assert len(firsts) + len(seconds) == len(seqs) and firsts
        assert len(firsts) <= SELF_CONFIG.num_prompts and len(seconds) <= len(firsts)
        second_turns += len(seconds)
        for prompt in seconds:  # the conversation so far: a first turn of this split, then its answer
            answer = prompt[prompt.index(2, 2) + 1 : prompt.index(3, prompt.index(2, 2))]
            assert any(
                prompt[: len(q)] == q and tokenizer.decode(answer) == tokenizer.decode(a).strip()
                for q, a in firsts
            )
        for tokens, n, hidden in seqs:
            greedy += check_against_target(native, tokens, n, hidden)
            question = tokens[: n - 1][
                len(tokens[: n - 1]) - tokens[: n - 1][::-1].index(2) :
            ]  # last user turn
            assert tokens[n - 1] == 3 and 2 not in question and tokenizer.decode(question).strip()
    assert second_turns > 0
    assert 0 < greedy < meta["num_sequences"]  # half the conversations are answered greedily


def test_target_written_turns_that_run_too_long_are_dropped(chatty, tmp_path, monkeypatch):
    """A user turn that reaches the length limit is not a turn: with a limit of 2 tokens none survives, and
    the data set is refused with one line, leaving nothing behind."""
    monkeypatch.setattr(data_module, "_USER_TURN_TOKENS", 2)
    with pytest.raises(ValueError, match="no usable user turn") as err:
        build_dataset(str(chatty[0]), tmp_path / "out", SELF_CONFIG)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_follow_ups_refuse_target_written_chats(self_written, tmp_path):
    with pytest.raises(ValueError, match="target-written chats"):
        add_follow_ups(self_written[0], tmp_path / "out", 1, CONFIG)
    assert not (tmp_path / "out").exists()


# --- the command line ---------------------------------------------------------------------------------------


def test_cli_drafter_data_merge(built, tmp_path, capsys):
    a, b = str(built["a"][0]), str(built["b"][0])
    status, out, _ = run_cli(capsys, "drafter-data", "--merge", a, b, "--out", str(tmp_path / "merged"))
    assert status == 0 and f"{2 * CONFIG.num_prompts} sequences" in out
    assert (tmp_path / "merged" / "train.safetensors").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--merge", "A"], "at least two data sets"),
        (["--merge", "A", "B", "--follow-ups", "1", "--from", "A"], "separate steps"),
        (["--follow-ups", "1"], "go together"),
        (["--follow-ups", "1", "--from", "MISSING"], "no drafter data set"),
        (["--prompts", "0"], "num_prompts must be"),
        (["--turns", "2"], "several turns need target-written questions"),
        (["--questions", "target", "--turns", "0"], "turns must be"),
        (["--questions", "target", "--first-prompt", "3"], "change the seed"),
        (["--target", "stories260K.bin"], "a llama2.c checkpoint has no chat template"),
        (["--seed", "-1"], "seed must be an integer in [0, 2**32)"),
    ],
)
def test_cli_drafter_data_bad_input(built, tmp_path, capsys, extra, message):
    a = str(built["a"][0])
    names = {"A": a, "B": str(built["b"][0]), "MISSING": str(tmp_path / "absent")}
    argv = [names.get(x, x) for x in extra]
    result = run_cli(capsys, "drafter-data", *argv, "--out", str(tmp_path / "x"))
    assert_usage_error(result, message)
    assert "Traceback" not in result[2] and not (tmp_path / "x").exists()
