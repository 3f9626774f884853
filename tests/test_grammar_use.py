"""Structured output where a user asks for it, on stories260K: the library (``GenerationOptions.constraint``,
``generate``'s ``json_schema``/``regex``/``grammar``, per-prompt options in ``generate_batch``, a request
whose grammar dead-ends failing alone), the command line (``--json-schema``, ``--regex``, ``--grammar`` on
``generate``, ``generate --batch`` and ``verispec batch``; bad ones refused before a model loads), batch
lines' own constraints, and the server's ``response_format`` through the ``openai`` client (streamed ==
whole == the library, chat and completions, strict or not)."""

from __future__ import annotations

import json
import re

import openai
import pytest

import verispec
from test_grammar import GREEDY, REGEX, SCHEMA
from test_server import client
from toy import single_threaded
from verispec import api, cli
from verispec.api import Speculator
from verispec.batch import BatchJob, read_requests
from verispec.errors import UsageError
from verispec.grammar import Constraint
from verispec.grammar.matcher import start_state
from verispec.models.registry import load_model
from verispec.options import GenerationOptions, SamplingParams
from verispec.server.app import Server, ServerConfig, serving

PROMPT = "Once upon a time"
LARK = 'start: "The " ("cat" | "dog") " is " /[a-z]{3,8}/ "."'


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return root, load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


def model_flags(root) -> list[str]:
    return ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]


def fits(kind: str, text: str) -> bool:
    """Whether ``text`` is what a constraint of ``kind`` (REGEX, SCHEMA or LARK) allows."""
    if kind == "json_schema":
        value = json.loads(text)
        return set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 12
    return (
        re.fullmatch(REGEX if kind == "regex" else r"The (cat|dog) is [a-z]{3,8}\.", text.strip()) is not None
    )


# ---------------------------------------------------------------------------------------------- library


def test_generate_takes_one_constraint_by_keyword(stories):
    root, _ = stories
    where = {
        "target": str(root / "stories260K.bin"),
        "tokenizer": str(root / "tok512.bin"),
        "drafter": "ngram",
    }
    for keyword, kind in (("regex", REGEX), ("json_schema", SCHEMA), ("grammar", LARK)):
        result = verispec.generate(PROMPT, **where, k=3, max_new_tokens=60, **{keyword: kind})
        assert fits(keyword, result.text) and result.stats["stop_reason"] == "eos", (keyword, result.text)
    with pytest.raises(
        UsageError, match="give one of json_schema, regex and grammar, not json_schema and regex"
    ):
        verispec.generate(PROMPT, **where, json_schema=SCHEMA, regex="a")
    with pytest.raises(UsageError, match="constraint must be a Constraint, got str"):
        GenerationOptions(constraint="a+")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="invalid regex") as err:
        Constraint.of(regex="[0-9")
    assert "\n" not in str(err.value)


DEAD_END = Constraint("regex", "[a-z ]+")  # its state made a dead end by dead_ends


def dead_ends(constraint, tokenizer):
    """start_state, but DEAD_END's state allows nothing after two committed tokens: a dead end."""
    real = start_state(constraint, tokenizer)
    if constraint != DEAD_END:
        return real

    class Dead:
        vocab_size = real.vocab_size
        committed: list[int] = []
        finished = False

        def mask_after(self, path):
            mask = real.mask_after(path)
            return mask if len(self.committed) + len(path) < 2 or mask is None else mask & False

        def settle(self, tokens):
            self.committed = [*self.committed, *tokens]
            real.settle(tokens)

    return Dead()


def test_generate_batch_takes_options_per_prompt_and_a_dead_end_fails_alone(stories, monkeypatch):
    """Per-prompt options (a regex, a schema, none, a dead end) in one continuous batch of two slots: each
    result == generating it alone; the dead end fails with its one line, the others untouched."""
    _, loaded = stories
    speculator = Speculator(loaded, drafter="ngram")
    monkeypatch.setattr(api, "start_state", dead_ends)
    each = [
        GenerationOptions(k=3, max_new_tokens=60, sampling=GREEDY, constraint=Constraint("regex", REGEX)),
        GenerationOptions(k=2, max_new_tokens=60, constraint=Constraint("json_schema", json.dumps(SCHEMA))),
        GenerationOptions(k=3, max_new_tokens=20, sampling=SamplingParams(temperature=0.8, seed=4)),
        GenerationOptions(k=3, max_new_tokens=20, constraint=DEAD_END),
    ]
    results = speculator.generate_batch([PROMPT] * 4, each, slots=2)
    assert results[3].error == "the grammar allows no token here: the output cannot be completed"
    for own, result in zip(each[:3], results[:3], strict=True):
        assert not result.error and result.token_ids == speculator.generate(PROMPT, own).token_ids
    assert fits("regex", results[0].text) and fits("json_schema", results[1].text)
    with pytest.raises(UsageError, match="2 options for 4 prompts"):
        speculator.generate_batch([PROMPT] * 4, each[:2])
    with pytest.raises(UsageError, match="the grammar allows no token here"):
        speculator.generate(PROMPT, each[3])


# ---------------------------------------------------------------------------------------------- CLI


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_constraint_flags(stories, tmp_path, capsys):
    root, _ = stories
    schema, grammar = tmp_path / "schema.json", tmp_path / "story.lark"
    schema.write_text(json.dumps(SCHEMA))
    grammar.write_text(LARK)
    for flag, value, kind in (("--regex", REGEX, "regex"), ("--json-schema", str(schema), "json_schema"),
                              ("--grammar", str(grammar), "grammar")):  # fmt: skip
        status, out, _ = run(capsys, "generate", PROMPT, flag, value, "--json", "--drafter", "ngram",
                             "--k", "3", *model_flags(root))  # fmt: skip
        result = json.loads(out)
        assert status == 0 and fits(kind, result["text"]) and result["stats"]["forced"] > 0, result["text"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["generate", "x", "--regex", "[0-9"], "invalid regex"),
        (["generate", "x", "--regex", "a", "--grammar", "g.lark"], "not allowed with argument --regex"),
        (["generate", "x", "--json-schema", "/no/such/schema.json"], "cannot read /no/such/schema.json"),
        (["generate", "x", "--json-schema", "BAD_SCHEMA"], "invalid JSON schema"),
        (["generate", "x", "--grammar", "BAD_GRAMMAR"], "invalid grammar"),
        (["generate", "--batch", "LINES", "--regex", "("], "invalid regex"),
        (
            ["batch", "--input", "LINES", "--output", "OUT", "--json-schema", "BAD_SCHEMA"],
            "invalid JSON schema",
        ),
    ],
)
def test_bad_constraints_are_refused_before_a_model_loads(capsys, monkeypatch, tmp_path, argv, fragment):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("verispec.resolve._load", load)
    files = {"BAD_SCHEMA": '{"type": "objectx"}', "BAD_GRAMMAR": "start: foo", "LINES": '{"prompt": "a"}'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path / a) if a in (*files, "OUT") else a for a in argv]
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == "" and err.count("\n") == 1 and fragment in err, err


# ---------------------------------------------------------------------------------------------- batches


def test_batch_lines_bring_their_own_constraints(stories, tmp_path, capsys):
    """Lines with a schema (object or text), a regex, a grammar or none beside a job's --regex; a bad one an
    error record naming its line; `generate --batch` and `verispec batch` alike; the job's constraint and
    the lines' in its resume settings."""
    root, _ = stories
    lines = [
        {"id": "object", "prompt": PROMPT, "json_schema": SCHEMA},
        {"id": "text", "prompt": PROMPT, "json_schema": json.dumps(SCHEMA)},
        {"id": "grammar", "prompt": PROMPT, "grammar": LARK},
        {"id": "job", "prompt": PROMPT},
        {"id": "bad", "prompt": PROMPT, "regex": "[0-9"},
        {"id": "two", "prompt": PROMPT, "regex": "a", "grammar": LARK},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    kinds = {"object": "json_schema", "text": "json_schema", "grammar": "grammar", "job": "regex"}
    flags = ["--regex", REGEX, "--drafter", "ngram", "--k", "3", "--max-new-tokens", "60", *model_flags(root)]
    status, out, _ = run(capsys, "generate", "--batch", str(source), "--json", *flags)
    records = {r["id"]: r for r in map(json.loads, out.splitlines())}
    status, _, _ = run(
        capsys, "batch", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), *flags
    )
    written = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}

    def same(records: dict) -> dict:  # the stats hold timings
        return {i: (r.get("text"), r.get("token_ids"), r.get("error")) for i, r in records.items()}

    assert status == 0 and same(written) == same(records)
    for ident, kind in kinds.items():
        assert fits(kind, records[ident]["text"]), (ident, records[ident])
    assert records["bad"]["error"].startswith(f"{source}:5: invalid regex")  # named by their ids
    assert (
        records["two"]["error"]
        == f"{source}:6: give one of json_schema, regex and grammar, not regex and grammar"
    )
    requests = read_requests(source)
    job = BatchJob(input=str(source), output="o", constraint=Constraint("regex", REGEX))
    other = BatchJob(input=str(source), output="o", constraint=Constraint("regex", "a+"))
    assert job.settings(requests, 1)["constraint"] == {"kind": "regex", "text": REGEX}
    assert job.settings(requests, 1) != other.settings(requests, 1)
    changed = [*requests[:2], (requests[2][0], requests[2][1], Constraint("regex", "b+")), *requests[3:]]
    assert job.settings(requests, 1)["requests"] != job.settings(changed, 1)["requests"]


# ---------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def served(stories):
    """(base URL, the library's speculator): stories260K drafting with ngram, its tokenizer given a plain
    chat template (stories260K has none) so that the chat endpoint runs too."""
    root, _ = stories
    model, tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    tokenizer.chat_prompt = lambda conversation: "".join(m["content"] for m in (  # type: ignore[method-assign]
        [{"content": conversation}] if isinstance(conversation, str) else conversation))  # fmt: skip
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="ngram", max_batch=2, k="3")
    with serving(Server(config, loaded=(model, tokenizer))) as url:
        yield url, Speculator((model, tokenizer), drafter="ngram")


FORMATS = {
    "json_object": {"type": "json_object"},
    "strict": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    "loose": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": False}},
}


@pytest.mark.parametrize("which", sorted(FORMATS))
def test_response_format_streamed_whole_chat_and_completions(served, which):
    """Each response_format on both endpoints: whole == streamed == the library (greedy); the text parses
    as JSON of the schema, strict or not (json_object: what the grammar of any object allows so far)."""
    url, speculator = served
    fmt, api = FORMATS[which], client(url)
    constraint = (
        Constraint("json_object") if which == "json_object" else Constraint("json_schema", json.dumps(SCHEMA))
    )
    library = speculator.generate(PROMPT, k=3, max_new_tokens=60, sampling=GREEDY, constraint=constraint)
    common = dict(model="stories260K", max_tokens=60, temperature=0)
    text = dict(prompt=PROMPT, extra_body={"response_format": fmt}, **common)  # not in the client's signature
    whole = api.completions.create(**text).choices[0].text
    streamed = "".join(c.choices[0].text for c in api.completions.create(**text, stream=True) if c.choices)
    chat = dict(messages=[{"role": "user", "content": PROMPT}], response_format=fmt, **common)
    answer = api.chat.completions.create(**chat).choices[0].message.content
    parts = api.chat.completions.create(**chat, stream=True)
    answer_streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert whole == streamed == answer == answer_streamed == library.text
    if which != "json_object":
        assert fits("json_schema", whole), whole
    else:  # any object: stories260K writes one longer than 60 tokens, a prefix the grammar allows
        assert (
            whole.startswith("{")
            and start_state(constraint, speculator.tokenizer).mask_after(library.token_ids) is not None
        )


def test_a_text_format_asks_for_nothing_and_a_bad_one_leaves_the_server_serving(served):
    url, speculator = served
    api = client(url)
    plain = speculator.generate(PROMPT, k=3, max_new_tokens=12, sampling=GREEDY).text
    common = dict(model="stories260K", prompt=PROMPT, max_tokens=12, temperature=0)
    text = {"response_format": {"type": "text"}}
    assert api.completions.create(**common, extra_body=text).choices[0].text == plain
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema") as info:
        api.completions.create(**common, extra_body={"response_format": bad})
    assert info.value.body["param"] == "response_format"
    assert api.completions.create(**common).choices[0].text == plain
