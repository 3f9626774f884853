"""Tests of the library's first minute: one default temperature with the command line, a one-line error for a
missing device and for transformers' keywords (naming verispec's own)."""

import inspect

import pytest

import verispec
from verispec import api, cli, options
from verispec.errors import UsageError


def test_library_and_cli_share_one_default_temperature():
    """Greedy, whether through verispec.generate, Speculator.request or verispec generate / batch."""
    assert options.DEFAULT_SAMPLING.greedy
    assert inspect.signature(api.generate).parameters["temperature"].default == 0
    for argv in (["generate", "x"], ["batch", "--input", "i", "--output", "o"]):
        assert cli.build_parser().parse_args(argv).temperature == options.DEFAULT_SAMPLING.temperature


@pytest.mark.parametrize(
    "keyword, use",
    [
        ("max_length", "use max_new_tokens"),
        ("do_sample", "use temperature"),
        ("beams", "use one of prompt, target"),
    ],
)
def test_transformers_keywords_are_one_line_errors_naming_ours(keyword, use):
    with pytest.raises(UsageError, match=f"^{keyword} is not a verispec argument; {use}"):
        verispec.generate("Once upon a time", **{keyword: 1})  # refused before any model loads


def test_speculator_methods_refuse_transformers_keywords(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    spec = verispec.Speculator(
        str(root / "stories260K.bin"), drafter="ngram", tokenizer=str(root / "tok512.bin")
    )
    for method in (spec.generate, lambda p, **o: list(spec.stream(p, **o)), spec.generate_batch):
        with pytest.raises(UsageError, match="^max_length is not a verispec argument; use max_new_tokens"):
            method(["Once"] if method == spec.generate_batch else "Once", max_length=8)
    assert spec.generate("Once", max_new_tokens=8).stats["new_tokens"] == 8  # greedy by default


def test_a_batch_of_prompts_is_a_list_never_one_prompt_read_letter_by_letter(shared_model):
    """A string is a sequence of letters to Python: generate_batch refuses one (and any single prompt)
    instead of answering each letter; any iterable of prompts is a batch, a generator's too."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    spec = verispec.Speculator(
        str(root / "stories260K.bin"), drafter="ngram", tokenizer=str(root / "tok512.bin")
    )
    for single in ("Once upon a time", b"Once", {"role": "user"}, 5):
        with pytest.raises(
            UsageError, match="^prompts is a list of prompts, not .* \\(one prompt: generate\\)"
        ):
            spec.generate_batch(single, max_new_tokens=3)
    lazily = spec.generate_batch((p for p in ["Once", "Tom"]), max_new_tokens=3)
    assert [r.text for r in lazily] == [spec.generate(p, max_new_tokens=3).text for p in ["Once", "Tom"]]
    torch = pytest.importorskip("torch")
    with pytest.raises(UsageError, match="^a prompt is text, a list of token ids .* not Tensor"):
        spec.generate(torch.tensor([1, 403, 261]), max_new_tokens=3)


@pytest.mark.parametrize("device", ["cuda:99", "mps:3", "nonsense"])
def test_a_device_not_on_this_machine_is_a_usage_error(device):
    with pytest.raises(UsageError, match="^(device|unknown device)"):
        verispec.Speculator(device=device)  # before any model loads


def test_a_next_turn_keeps_the_last_streams_keys_and_values(shared_model):
    """Streams on one speculator share its engine: a prompt that begins with the last prompt and its output
    keeps that start (cached_prompt_tokens) and gives the tokens a fresh speculator gives, greedy and sampled
    with a seed; a reader that leaves early frees the slot, and a stream opened while another is open runs
    beside it on an engine of its own, the same tokens again."""
    from verispec.api import Speculator
    from verispec.engine.sequence import GenerationStats
    from verispec.options import GenerationOptions, SamplingParams

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    target = str(root / "stories260K.bin")
    tokenizer = str(root / "tok512.bin")
    for sampling in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3)):
        options = GenerationOptions(k=3, max_new_tokens=24, sampling=sampling)
        spec = Speculator(target, drafter="ngram", tokenizer=tokenizer)
        first = spec.generate("Once upon a time", options)
        follow = "Once upon a time" + first.text + " The end. Then"
        stats = GenerationStats("ngram", "3")
        again = spec.generate(follow, options, stats=stats)
        fresh = Speculator(target, drafter="ngram", tokenizer=tokenizer).generate(follow, options)
        assert again.token_ids == fresh.token_ids and stats.cached_prompt_tokens > 10
        left = spec.stream(follow, options)
        next(left)  # open: the speculator's engine is taken
        beside = spec.generate(follow, options)  # on an engine of its own
        assert beside.token_ids == fresh.token_ids
        left.close()  # the reader leaves early: its slot freed, the engine free again
        assert spec.generate(follow, options).token_ids == fresh.token_ids


def test_sampling_keywords_are_taken_alike_by_generate_and_the_speculators_methods(shared_model):
    """Issue 52: ``verispec.generate(..., temperature=0)`` took the sampling's fields as keywords while
    ``Speculator.stream(..., temperature=0.5)`` refused them; every method takes them now, over the options'
    sampling, never beside ``sampling=``; a misspelt one names the closest."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    spec = verispec.Speculator(
        str(root / "stories260K.bin"), drafter="ngram", tokenizer=str(root / "tok512.bin")
    )
    sampled = options.SamplingParams(temperature=0.5, top_k=20, seed=7)  # invariant: a seed is given
    reference = spec.generate("Once upon a time", sampling=sampled, max_new_tokens=12, k=2)
    streamed = spec.stream("Once upon a time", temperature=0.5, top_k=20, seed=7, max_new_tokens=12, k=2)
    assert [t for chunk in streamed for t in chunk.token_ids] == reference.token_ids
    (batched,) = spec.generate_batch(
        ["Once upon a time"], temperature=0.5, top_k=20, seed=7, max_new_tokens=12
    )
    assert batched.token_ids == reference.token_ids  # invariant draws: the same whatever K
    greedy = options.GenerationOptions(sampling=sampled)
    assert spec.generate("Tom", greedy, temperature=0, max_new_tokens=6).token_ids == (
        spec.generate("Tom", max_new_tokens=6).token_ids
    )
    with pytest.raises(UsageError, match="^give sampling= or its fields \\(temperature=\\), not both$"):
        spec.generate("Tom", sampling=sampled, temperature=0.5)
    with pytest.raises(
        UsageError, match="^temprature is not a verispec argument \\(did you mean temperature\\?\\)"
    ):
        list(spec.stream("Tom", temprature=0.5))
    for wrong, said in [
        ({"k": 4}, "^k is each generation's option \\(generate, stream, generate_batch: k=...\\)"),
        ({"temprature": 1}, "^temprature \\(did you mean temperature\\?\\) is each generation's option"),
        ({"tokeniser": "t"}, "^tokeniser is not a verispec argument \\(did you mean tokenizer\\?\\)"),
    ]:  # the speculator's own keywords: one line, never a TypeError
        with pytest.raises(UsageError, match=said):
            verispec.Speculator(target="unused", **wrong)
    with pytest.raises(UsageError, match="^constraint is not a verispec argument; use one of prompt"):
        verispec.generate("Tom", constraint=None)  # the function's own words (json_schema=...), not the hint
    for conversation, said in [
        ([{"role": "user"}], "message 0's content must be text"),  # generated from before
        ([{"content": "x"}], "message 0 needs a role"),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}], "message 1's content"),
    ]:  # as a batch file's lines are: one line (an assistant's calls may stand without content)
        with pytest.raises(UsageError, match=said):
            spec.encode_prompt(conversation, chat=True)


def test_a_target_loaded_once_drafts_beside_every_drafter(shared_model, monkeypatch):
    """Issue 53's one door: a ModelChoice's target loaded once (Target.load), then a speculator per drafter
    beside it (Speculator.on), none loading the target again; each one's output == the public constructor's
    for the same choice, and the label names the target for every drafter."""
    from verispec import resolve
    from verispec.choice import ModelChoice
    from verispec.drafting.registry import PLAIN
    from verispec.resolve import Target

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model, tokenizer = str(root / "stories260K.bin"), str(root / "tok512.bin")
    choice = ModelChoice(target=model, tokenizer=tokenizer, drafter=PLAIN)
    target = Target.load(choice)
    assert (target.label, target.precision) == (model, choice.precision)
    loads = []
    monkeypatch.setattr(resolve, "load_model", lambda *a, **k: loads.append(a))
    made = {name: api.Speculator.on(target, drafter=name) for name in ("ngram", "suffix")}
    made[PLAIN] = api.Speculator.on(target)  # the choice's own drafter
    assert not loads
    assert {name: s.drafter_name for name, s in made.items()} == {n: n for n in ("ngram", "suffix", PLAIN)}
    assert all(s.model is target.model and s.parts.target_label == model for s in made.values())
    monkeypatch.undo()
    for name, speculator in made.items():
        alone = verispec.Speculator(model, drafter=name, tokenizer=tokenizer)
        ask = {"max_new_tokens": 24, "k": 3}
        assert (
            speculator.generate("Once upon a time", **ask).token_ids
            == alone.generate("Once upon a time", **ask).token_ids
        )
    with pytest.raises(UsageError, match="^give the drafter that drafts from drafter_path$"):
        api.Speculator.on(target, drafter_path="x.safetensors")
    with pytest.raises(UsageError, match="needs a draft model"):
        api.Speculator.on(target, drafter="model")


def test_a_draft_loads_with_its_own_tokenizer_unless_it_is_a_llama2c_checkpoint():
    """--draft-tokenizer where given; else a llama2.c draft (no tokenizer of its own) takes the target's
    --tokenizer, and any other draft its own: a GGUF draft beside a llama2.c target drafts across
    tokenizers (the target's tok512.bin was forced on it: "512 ids and the model's vocabulary 49152")."""
    from verispec.choice import ModelChoice

    def spec(draft: str, draft_tokenizer: str | None = None) -> str | None:
        choice = ModelChoice(target="t.bin", tokenizer="tok.bin", drafter="model", draft=draft,
                             draft_tokenizer=draft_tokenizer)  # fmt: skip
        return choice.draft_tokenizer_spec

    assert spec("d.gguf") is None and spec("smollm2-135m") is None and spec("some/dir") is None
    assert spec("d.bin") == "tok.bin"
    assert spec("d.bin", "dtok.bin") == spec("d.gguf", "dtok.bin") == "dtok.bin"


def test_an_early_exit_as_deep_as_its_target_is_one_line_naming_it(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    with pytest.raises(UsageError, match="^layers:5 needs a target of more layers; this one has 5$"):
        verispec.Speculator(
            str(root / "stories260K.bin"), tokenizer=str(root / "tok512.bin"), draft="layers:5"
        )
