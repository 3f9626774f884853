"""Training data for learned drafters, made offline: the target's own answers to a generated prompt set.

A learned drafter should predict what the target will say, so the best data is the target itself talking
(self-distillation, as Medusa-2 and EAGLE's later versions do). No model hub or text corpus is needed:

- :func:`verispec.training.prompts.chat_prompts` writes a deterministic, varied set of chat requests from
  templates and word lists (see :mod:`verispec.training.prompts`). None of them is a bench prompt.
- :func:`build_dataset` has the target answer each prompt in its chat template — half greedily, half sampled
  at temperature 1, so that the drafter sees what it must predict at both settings — in verispec's own
  continuous batches, the target loaded as generate loads it (``DataConfig.precision``: by default the
  checkpoint's own format on the native kernels, SmolLM2's Q4_1 — the weights the drafter will draft for),
  and keeps the target's final hidden state at every position (what ``Llama.forward_hidden`` returns, from
  which the next token's logits are computed); :func:`drafter_data_on_ray` has Ray workers answer ranges of
  the prompt set, merged.

The data set is a directory: ``meta.json`` and ``train.safetensors`` / ``heldout.safetensors``, each holding
``tokens`` int32 [T_total] (sequences concatenated: prompt, then the answer), ``hidden`` float16 [T_total, H],
``offsets`` int64 [S+1] (sequence s is ``tokens[offsets[s]:offsets[s+1]]``) and ``prompt_lengths`` int64 [S].
The last token of each sequence is dropped: generation never feeds it, so it has no hidden state.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from verispec.batch import connect_ray
from verispec.choice import DEFAULT_PRECISION
from verispec.drafting.learned.head import native_target
from verispec.drafting.registry import PLAIN
from verispec.errors import UsageError
from verispec.files import atomic_path, atomic_write
from verispec.inputs import check_int, check_seed
from verispec.training.prompts import FOLLOW_UPS, chat_prompts

if TYPE_CHECKING:
    from verispec.api import Speculator
    from verispec.models.base import LanguageModel

__all__ = [
    "DataConfig",
    "add_follow_ups",
    "answered_precision",
    "build_dataset",
    "drafter_data_on_ray",
    "load_split",
    "load_splits",
    "merge_datasets",
    "target_sizes",
    "read_data_meta",
    "write_dataset",
]


@dataclass(frozen=True)
class DataConfig:
    """What :func:`build_dataset` generates; validated with UsageError."""

    num_prompts: int = 1024
    max_new_tokens: int = 192
    batch_size: int = 32
    heldout_fraction: float = 0.05
    seed: int = 0
    progress: bool = True  # a tqdm progress bar
    first_prompt: int = 0  # answer prompts first_prompt .. first_prompt + num_prompts - 1 of the prompt set
    questions: str = "templates"  # who writes the user turns: "templates" (chat_prompts) or "target" (itself)
    turns: int = 1  # user turns per conversation ("target" questions only)
    # the target's weights (verispec.models.llama.PRECISION_CHOICES): its drafters' own by default, the
    # precision generate runs it in, so that the drafter learns the hidden states it will read
    precision: str = DEFAULT_PRECISION

    def __post_init__(self) -> None:
        check_seed(self.seed, below=2**32)  # the answers' seeds are derived from it (seed · 100003 + ...)
        for name in ("num_prompts", "max_new_tokens", "batch_size", "first_prompt", "turns"):
            value = getattr(self, name)
            low = {"first_prompt": 0}.get(name, 1)
            check_int(value, name, low)
        if not 0 < self.heldout_fraction < 1:
            raise UsageError(f"heldout_fraction must lie in (0, 1), got {self.heldout_fraction!r}")
        from verispec.models.llama import check_precision

        check_precision(self.precision)
        if self.questions not in ("templates", "target"):
            raise UsageError(f'questions must be "templates" or "target", got {self.questions!r}')
        if self.questions == "templates" and self.turns != 1:
            raise UsageError(
                "several turns need target-written questions (template chats get follow-ups instead)"
            )
        if self.questions == "target" and self.first_prompt:
            raise UsageError(
                "first_prompt numbers the template prompt set: for more target-written chats, change the seed"
            )


def _write_split(path: Path, sequences: list[tuple[list[int], int, Tensor | None]]) -> None:
    """Atomically write (tokens, prompt length, hidden or None: a text data set's) sequences to a safetensors
    file."""
    from safetensors.torch import save_file

    lengths = torch.tensor([len(t) for t, _, _ in sequences])
    tensors = {
        "tokens": torch.tensor([x for t, _, _ in sequences for x in t], dtype=torch.int32),  # [T_total]
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),  # [S+1]
        "prompt_lengths": torch.tensor([n for _, n, _ in sequences], dtype=torch.long),  # [S]
    }
    states = [h for _, _, h in sequences if h is not None]
    if states:
        tensors["hidden"] = torch.cat(states)  # [T_total, H] float16
    with atomic_path(path) as tmp:
        save_file(tensors, tmp)


def _load_target(target: str, precision: str) -> Speculator:
    """The target as verispec runs it in ``precision`` (the weights its drafters will read the hidden states
    of), drafting nothing: it answers the prompts in continuous batches."""
    from verispec.api import Speculator

    speculator = Speculator(target, drafter=PLAIN, precision=precision)
    native_target(speculator.model)  # UsageError for a target learned drafters cannot read
    return speculator


def _generate_all(
    speculator: Speculator,
    prompts: list[list[int]],
    sampled: list[bool],
    max_new_tokens: int,
    seed: int,
    config: DataConfig,
    desc: str,
) -> list[tuple[list[int], Tensor] | None]:
    """The target's continuation of every token prompt (greedy, or sampled at temperature 1 with seed
    ``seed + i`` where ``sampled[i]``), in continuous batches of ``config.batch_size`` rows, in prompt order,
    each as (prompt + continuation minus its last token, hidden [L - 1, H] float16): the last token (an end
    token, or the last one the limit or the context allowed) is never fed, so it has no hidden state; hidden
    state i is the target's final one at token i, recomputed over the whole sequence in one forward. None for
    a prompt that fills the target's context (left out, said on stderr)."""
    from tqdm import tqdm

    from verispec.options import DraftLength, GenerationOptions, SamplingParams

    each = {
        sample: GenerationOptions(
            k=DraftLength(fixed=0),
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature=1.0 if sample else 0.0),
        )
        for sample in (False, True)
    }
    model = native_target(speculator.model)
    out: list[tuple[list[int], Tensor] | None] = [None] * len(prompts)
    fits = [i for i, prompt in enumerate(prompts) if len(prompt) < model.max_context]
    chunk = 8 * config.batch_size  # prompts per continuous batch: the progress bar moves between them
    with tqdm(total=len(fits), desc=desc, unit="prompt", disable=not config.progress) as bar:
        for first in range(0, len(fits), chunk):
            rows = fits[first : first + chunk]
            results = speculator.generate_batch(
                [prompts[i] for i in rows],
                [each[sampled[i]] for i in rows],
                slots=config.batch_size,
                seeds=[seed + i for i in rows],
            )
            for i, result in zip(rows, results, strict=True):
                if result.error:
                    raise UsageError(f"the target could not answer prompt {i}: {result.error}")
                tokens = [*prompts[i], *result.token_ids][:-1]
                ids = torch.tensor([tokens])  # [1, L - 1]
                with torch.inference_mode():
                    hidden = model.forward_hidden(
                        ids, torch.arange(len(tokens))[None], model.new_cache(1, len(tokens))
                    )
                out[i] = (tokens, hidden[0].to(torch.float16))  # [L - 1, H]
            bar.update(len(rows))
    if len(fits) < len(prompts):
        print(
            f"verispec: {desc}: {len(prompts) - len(fits)} of {len(prompts)} prompts left out, as long as "
            f"the target's context ({model.max_context} tokens) or longer",
            file=sys.stderr,
        )
    return out


def _answer_all(
    speculator: Speculator,
    prompts: list[list[int]],
    heldout: set[int],
    config: DataConfig,
    desc: str,
):
    """The target's answers to every prompt (even indices greedy, odd sampled); returns {"train": [...],
    "heldout": [...]} of (tokens, prompt length, hidden) in prompt order."""
    splits: dict[str, list] = {"train": [], "heldout": []}
    order = list(range(len(prompts)))
    _answer_into(splits, speculator, order, prompts, heldout, config.seed * 100003, config, desc)
    return splits


def _answer_into(
    splits: dict[str, list],
    speculator: Speculator,
    order: list[int],
    prompts: list[list[int]],
    heldout: set[int],
    seed: int,
    config: DataConfig,
    desc: str,
) -> list[list[int] | None]:
    """Answers ``prompts[j]``, the prompt of conversation ``order[j]`` (even conversations greedy, odd
    sampled), appending (tokens, prompt length, hidden) to that conversation's split of ``splits``; returns
    the answered sequences' tokens (None: a prompt left out, see :func:`_generate_all`)."""
    sampled = [i % 2 == 1 for i in order]
    answers = _generate_all(speculator, prompts, sampled, config.max_new_tokens, seed, config, desc)
    for i, prompt, answer in zip(order, prompts, answers, strict=True):
        if answer is not None:
            splits["heldout" if i in heldout else "train"].append((answer[0], len(prompt), answer[1]))
    return [None if answer is None else answer[0] for answer in answers]


_STREAM = 1_000_000  # seed offset between the sampling streams of target-written chats (> any batch start)
_USER_TURN_TOKENS = 96  # the longest user turn the target may write
_MARK = "VERISPEC-USER-TURN"


def _user_turn_prefix(tokenizer, conversation: list[dict[str, str]]) -> list[int]:
    """The token ids of ``conversation`` in the chat template, followed by the opening of a user turn."""
    text = tokenizer.chat_prompt([*conversation, {"role": "user", "content": _MARK}])
    return tokenizer.encode(text[: text.index(_MARK)], add_bos=True)


def _write_user_turns(
    speculator: Speculator, conversations: list[list[dict[str, str]]], config: DataConfig, turn: int
) -> list[str | None]:
    """The next user turn of each conversation, written by the target itself (Magpie-style: the chat template
    up to a user turn's text, sampled at temperature 1 until the turn ends), or None where it wrote nothing
    or ran past ``_USER_TURN_TOKENS``."""
    tokenizer = speculator.tokenizer
    prefixes = [_user_turn_prefix(tokenizer, c) for c in conversations]
    seed = config.seed * 100003 + (2 * turn + 1) * _STREAM
    written = _generate_all(
        speculator,
        prefixes,
        [True] * len(prefixes),
        _USER_TURN_TOKENS,
        seed,
        config,
        f"user turns {turn + 1}",
    )
    turns: list[str | None] = []
    for prefix, answer in zip(prefixes, written, strict=True):
        if answer is None:  # the conversation fills the context
            turns.append(None)
            continue
        tokens = answer[0]
        text = tokenizer.decode(tokens[len(prefix) :]).strip()
        # _generate_all drops the last token: a turn that hit the limit keeps _USER_TURN_TOKENS - 1
        finished = len(tokens) - len(prefix) < _USER_TURN_TOKENS - 1
        turns.append(text if text and finished else None)
    return turns


def _self_written(speculator: Speculator, heldout: set[int], config: DataConfig) -> dict[str, list]:
    """Conversations the target writes on both sides: ``config.turns`` rounds of a user turn it writes
    (:func:`_write_user_turns`) and its answer (even conversations greedy, odd sampled). Every answered turn
    is one sequence (the conversation so far, then the answer); a conversation ends early where a user turn
    fails. Conversation i goes to the held-out split when i is in ``heldout``."""
    tokenizer = speculator.tokenizer
    # conversation index -> messages so far
    alive: dict[int, list[dict[str, str]]] = {i: [] for i in range(config.num_prompts)}
    splits: dict[str, list] = {"train": [], "heldout": []}
    for turn in range(config.turns):
        order = sorted(alive)
        questions = _write_user_turns(speculator, [alive[i] for i in order], config, turn)
        alive = {
            i: [*alive[i], {"role": "user", "content": q}]
            for i, q in zip(order, questions, strict=True)
            if q is not None
        }
        order = sorted(alive)
        prompts = [tokenizer.encode(tokenizer.chat_prompt(alive[i]), add_bos=True) for i in order]
        seed = config.seed * 100003 + (2 * turn + 2) * _STREAM
        answered = _answer_into(
            splits, speculator, order, prompts, heldout, seed, config, f"answers {turn + 1}"
        )
        for i, prompt, tokens in zip(order, prompts, answered, strict=True):
            if tokens is None:  # the conversation fills the context: it ends here
                del alive[i]
                continue
            reply = tokenizer.decode(tokens[len(prompt) :]).strip()
            alive[i] = [*alive[i], {"role": "assistant", "content": reply}]
    for name, sequences in splits.items():
        if not sequences:
            raise UsageError(
                f"the target wrote no usable user turn for the {name} split: ask for more prompts"
            )
    return splits


def write_dataset(out: Path, splits: dict[str, list], meta: dict, started: float) -> dict:
    """Write the splits and meta.json (with the counts) into ``out``; returns the meta data. UsageError, and
    nothing written, where a split holds no sequence (its every prompt left out)."""
    for name, sequences in splits.items():
        if not sequences:
            raise UsageError(f"no sequence for the {name} split (its prompts fill the context): ask for more")
    out.mkdir(parents=True, exist_ok=True)
    for name, sequences in splits.items():
        _write_split(out / f"{name}.safetensors", sequences)
    meta |= {
        "num_sequences": sum(len(seqs) for seqs in splits.values()),
        "num_tokens": sum(len(t) for seqs in splits.values() for t, _, _ in seqs),
        "answer_tokens": sum(len(t) - n for seqs in splits.values() for t, n, _ in seqs),
        "splits": {name: len(seqs) for name, seqs in splits.items()},
        "seconds": round(meta.get("seconds", 0) + time.perf_counter() - started, 1),
    }
    atomic_write(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _prompt_texts(first: int, count: int, seed: int) -> list[str]:
    """Prompts ``first`` .. ``first + count - 1`` of the prompt set of ``seed`` (chat_prompts makes its
    prompts one after another, so a longer set begins with a shorter one)."""
    return chat_prompts(first + count, seed)[first:]


def target_sizes(model: LanguageModel) -> dict[str, int]:
    """What a data set records of the target that made it, and what training checks against its own: the
    width of its hidden states and of its logits (not its tokenizer's count, which may say more)."""
    native = native_target(model)
    return {"hidden_size": int(native.config.hidden_size), "vocab_size": int(native.vocab_size)}


def build_dataset(target: str, out: str | Path, config: DataConfig = DataConfig()) -> dict:
    """Generate the data set of ``target`` (a model SPEC) into directory ``out``; returns its meta data.

    Prompt i is answered greedily when i is even, sampled at temperature 1 when odd; a random
    ``heldout_fraction`` of the prompts (by seed) forms the held-out split."""
    started = time.perf_counter()
    speculator = _load_target(target, config.precision)
    tokenizer = speculator.tokenizer
    order = list(range(config.num_prompts))
    random.Random(config.seed).shuffle(order)
    heldout = set(order[: max(1, round(config.heldout_fraction * len(order)))])
    if config.questions == "target":
        splits = _self_written(speculator, heldout, config)
        prompts = {
            "prompts": "written by the target (verispec.training.data._write_user_turns)",
            "turns": config.turns,
            "user_turn_tokens": _USER_TURN_TOKENS,
        }
    else:
        texts = _prompt_texts(config.first_prompt, config.num_prompts, config.seed)
        prompt_ids = [tokenizer.encode(tokenizer.chat_prompt(t), add_bos=True) for t in texts]
        splits = _answer_all(speculator, prompt_ids, heldout, config, "target answers")
        prompts = {
            "prompts": "verispec.training.prompts.chat_prompts",
            "first_prompt": config.first_prompt,
        }
    meta = {
        "target": str(target),
        **target_sizes(speculator.model),
        "generation": {
            **prompts,
            "num_prompts": config.num_prompts,
            "max_new_tokens": config.max_new_tokens,
            "batch_size": config.batch_size,
            "sampling": "even prompts greedy, odd prompts temperature 1",
            "seed": config.seed,
            "precision": config.precision,
            "threads": torch.get_num_threads(),
        },
    }
    return write_dataset(Path(out), splits, meta, started)


def read_data_meta(directory: str | Path) -> dict:
    """The ``meta.json`` of the drafter data set in ``directory``; UsageError when there is none."""
    meta_path = Path(directory) / "meta.json"
    if not meta_path.is_file():
        raise UsageError(
            f"no drafter data set in {directory} (no meta.json): build it with verispec drafter-data"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"{meta_path} is not readable JSON: {err}") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{meta_path} does not hold a JSON object")
    return meta


def _sequences(directory: str | Path, split: str) -> list[tuple[list[int], int, Tensor]]:
    """The (tokens, prompt length, hidden [L, H]) sequences of one split of a data set."""
    data = load_split(directory, split)
    offsets, lengths = data["offsets"].tolist(), data["prompt_lengths"].tolist()
    return [
        (data["tokens"][a:b].tolist(), n, data["hidden"][a:b])
        for a, b, n in zip(offsets, offsets[1:], lengths, strict=False)
    ]


def add_follow_ups(
    source: str | Path, out: str | Path, count: int, config: DataConfig = DataConfig()
) -> dict:
    """A new data set in ``out``: every sequence of ``source`` (made by :func:`build_dataset`), plus second
    turns — the first ``count`` conversations of each split continued with a follow-up request
    (:data:`verispec.training.prompts.FOLLOW_UPS`, by seed) and the target's answer — so that the
    drafter also sees multi-turn chats. A follow-up stays in its conversation's split. Returns the new meta
    data."""
    started = time.perf_counter()
    source = Path(source)
    meta = read_data_meta(source)
    if count < 1:
        raise UsageError(f"follow-ups must be >= 1, got {count}")
    generation = meta.get("generation")
    if not isinstance(generation, dict) or "num_prompts" not in generation:
        raise UsageError(
            f"{source} does not record one prompt set (a merged data set?): add follow-ups before merging"
        )
    if "turns" in generation:
        raise UsageError(f"{source} holds target-written chats: ask for more turns with --turns instead")
    speculator = _load_target(meta["target"], answered_precision(meta))
    tokenizer = speculator.tokenizer
    texts = _prompt_texts(generation.get("first_prompt", 0), generation["num_prompts"], generation["seed"])
    by_prompt = {tuple(tokenizer.encode(tokenizer.chat_prompt(t), add_bos=True)): t for t in texts}
    rng = random.Random(config.seed)
    splits: dict[str, list] = {}
    conversations: list[list[dict[str, str]]] = []  # each: its {"role", "content"} messages
    heldout: set[int] = set()  # indices of the conversations of the held-out split
    for name in ("train", "heldout"):
        splits[name] = _sequences(source, name)
        for tokens, n, _ in splits[name][:count]:
            question = by_prompt.get(tuple(tokens[:n]))
            if question is None:
                raise UsageError(
                    f"{source} was not made from verispec's prompt set: cannot rebuild its chats"
                )
            answer = tokenizer.decode(tokens[n:])
            heldout.update([len(conversations)] if name == "heldout" else [])
            conversations.append(
                [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": rng.choice(FOLLOW_UPS)},
                ]
            )
    prompts = [tokenizer.encode(tokenizer.chat_prompt(c), add_bos=True) for c in conversations]
    second = _answer_all(speculator, prompts, heldout, config, "follow-up answers")
    merged = {name: splits[name] + second[name] for name in splits}
    meta["generation"]["follow_ups"] = {
        "per_split": count,
        "requests": "verispec.training.prompts.FOLLOW_UPS",
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
    }
    return write_dataset(Path(out), merged, meta, started)


def answered_precision(meta: dict) -> str:
    """The precision the target answered a data set's prompts in (fp32: one made before it was recorded)."""
    generation = meta.get("generation")
    return str(generation.get("precision", "fp32")) if isinstance(generation, dict) else "fp32"


def merge_datasets(sources: list[str | Path], out: str | Path) -> dict:
    """A new data set in ``out`` holding every sequence of ``sources`` (each made by :func:`build_dataset` or
    :func:`add_follow_ups` for one target), split by split: the way to grow a data set with new prompts
    (``DataConfig.first_prompt``). Returns the new meta data; UsageError for fewer than two sources, a
    missing one, or sources made by different targets."""
    started = time.perf_counter()
    if len(sources) < 2:
        raise UsageError(f"merging needs at least two data sets, got {len(sources)}")
    metas = [read_data_meta(source) for source in sources]
    made_by = {
        (m.get("target"), m.get("hidden_size"), m.get("vocab_size"), answered_precision(m)) for m in metas
    }
    if len(made_by) > 1:
        raise UsageError(f"the data sets were made by different targets: {sorted(map(str, made_by))}")
    splits: dict[str, list] = {}
    for name in ("train", "heldout"):
        splits[name] = [seq for source in sources for seq in _sequences(source, name)]
    meta = {
        "target": metas[0].get("target"),
        "hidden_size": metas[0].get("hidden_size"),
        "vocab_size": metas[0].get("vocab_size"),
        "generation": {
            "merged": [m.get("generation") for m in metas],
            "precision": answered_precision(metas[0]),
        },
        "seconds": sum(m.get("seconds", 0) for m in metas),
    }
    return write_dataset(Path(out), splits, meta, started)


def load_split(directory: str | Path, split: str, hidden: bool = True) -> dict[str, Tensor]:
    """One split ("train" or "heldout") of a data set made by :func:`build_dataset` or
    :func:`~verispec.training.text.build_text_dataset`, checked; ``hidden`` False: its hidden states not read
    (``hidden`` [N, 0]: a recipe that recomputes them). UsageError for hidden states asked of a data set of
    token ids alone (a text data set)."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / f"{split}.safetensors"
    if not path.is_file():
        raise UsageError(f"{path} does not exist: build the data set with `verispec drafter-data` first")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = set(f.keys())
            data = {name: f.get_tensor(name) for name in names if hidden or name != "hidden"}
    except (SafetensorError, OSError, RuntimeError) as err:
        raise UsageError(f"{path} is not a readable safetensors file: {err}") from err
    missing = {"tokens", "offsets", "prompt_lengths"} - names
    if missing:
        raise UsageError(f"{path} lacks {', '.join(sorted(missing))}: not a verispec drafter data set")
    if hidden and "hidden" not in names:
        raise UsageError(
            f"{path} holds token ids alone (a text data set): the eagle3 recipe, which recomputes the "
            "target's states, trains on it"
        )
    if not hidden:
        data["hidden"] = torch.empty(data["tokens"].shape[0], 0, dtype=torch.float16)
    if (
        data["hidden"].shape[0] != data["tokens"].shape[0]
        or int(data["offsets"][-1]) != data["tokens"].shape[0]
    ):
        raise UsageError(f"{path} is inconsistent: tokens, hidden and offsets disagree")
    return data


def load_splits(directories: list[Path], split: str, hidden: bool = True) -> dict[str, Tensor]:
    """One split of several data sets (:func:`load_split` each), their sequences one after another."""
    parts = [load_split(directory, split, hidden) for directory in directories]
    if len(parts) == 1:
        return parts[0]
    ends = torch.tensor([0] + [int(p["offsets"][-1]) for p in parts]).cumsum(0)  # [D+1]
    offsets = [p["offsets"][1:] + ends[i] for i, p in enumerate(parts)]
    return {
        "tokens": torch.cat([p["tokens"] for p in parts]),
        "hidden": torch.cat([p["hidden"] for p in parts]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), *offsets]),
        "prompt_lengths": torch.cat([p["prompt_lengths"] for p in parts]),
    }


def drafter_data_on_ray(target: str, out: str | Path, config: DataConfig, address: str, workers: int) -> dict:
    """``verispec drafter-data --ray``: the template prompts ``config.first_prompt ..`` cut into ``workers``
    ranges (even-sized, so that each prompt keeps its parity: even prompts are answered greedily, odd ones
    sampled), each answered by a Ray task into ``OUT.parts/range-i`` (a filesystem the workers share: on one
    machine, always), then merged into ``out`` as ``--merge`` does. The prompts and the greedy answers are
    those of a one-machine run; sampled answers and the held-out choice are drawn per range. Returns the
    merged data set's meta data."""
    if config.questions != "templates":
        raise UsageError("--ray cuts the template prompt set into ranges: target-written questions run here")
    check_int(workers, "--workers", 1)
    out = Path(out)
    if out.exists():
        raise UsageError(f"{out} exists: remove it or choose another directory")
    ray = connect_ray(address)
    step = -(-config.num_prompts // workers)
    step += step % 2  # even, so that every range starts on an even prompt
    ranges = [(a, min(step, config.num_prompts - a)) for a in range(0, config.num_prompts, step)]
    parts = Path(f"{out}.parts")
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // len(ranges))

    def answer(first: int, count: int, where: str) -> str:
        import torch

        torch.set_num_threads(cpus)
        part = dataclasses.replace(config, first_prompt=config.first_prompt + first, num_prompts=count)
        build_dataset(target, where, dataclasses.replace(part, progress=False))
        return where

    task = ray.remote(num_cpus=cpus)(answer)
    done = ray.get([task.remote(a, n, str(parts / f"range-{i}")) for i, (a, n) in enumerate(ranges)])
    if len(done) == 1:
        shutil.move(done[0], out)
        meta = json.loads((out / "meta.json").read_text())
    else:
        meta = merge_datasets(done, out)
    shutil.rmtree(parts, ignore_errors=True)
    return meta
