"""Issue 52's hostile requests against ``verispec serve`` on 127.0.0.1 (stories260K), each a regression test
of its defect: a long ``const`` forced over bounded rounds, never one forward (D1), its forced text never
tokenized whole at each token (D2), /metrics' draft positions bounded (D3), a schema whose grammar cannot
start refused as a 400 before a stream begins (D6), the tenants' cache files private and named under a secret
salt, their figures out of /metrics (D9), ``--allow-drafters`` (D10, in test_server.py too), ``k`` and
``top_k`` bounded without echoing them (D11), a prompt refused by its bytes before it is tokenized (D12),
OpenAI's ``messages[].name``, a lower-case ``bearer`` and ``max_tokens`` beside ``max_completion_tokens``
(D13), and the stream's usage chunk carrying the ``verispec`` object. Every client call has a timeout."""

from __future__ import annotations

import json
import os
import platform
import stat
import subprocess
import sys
import weakref

import pytest

from test_server import GOOD, client, raw, scrape, stories  # noqa: F401 - stories: the fixture
from verispec import cli
from verispec.api import Speculator
from verispec.engine.engine import ROUND_TOKENS, SpeculativeEngine
from verispec.grammar import tokens as tokens_module
from verispec.grammar.constraint import Constraint
from verispec.options import MAX_K, GenerationOptions, SamplingParams
from verispec.server import app
from verispec.server import schema as schema_module
from verispec.server.app import Server, ServerConfig, serving
from verispec.server.metrics import POSITIONS
from verispec.server.tenants import installation_salt, tenant_id, tenants_dir

GREEDY = SamplingParams(temperature=0)
WORDS = "once upon a time there was a little girl who liked to play in the park with her dog "
LONG = (WORDS * 8).strip()  # forced: about 300 of stories260K's tokens
JSON = {"content-type": "application/json"}


def const(value: str) -> Constraint:
    """JSON that is ``value``."""
    return Constraint("json_schema", json.dumps({"const": value}))


def const_format(value: str) -> dict:
    """A response_format asking for JSON that is ``value``."""
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": value}}}
    }


@pytest.fixture(scope="module")
def served(stories):  # noqa: F811
    """(base URL, Server): stories260K drafting with ngram, 2 slots."""
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="ngram", max_batch=2, k="4")
    server = Server(config, loaded=loaded)
    with serving(server) as url:
        yield url, server


def post(url: str, body: dict | bytes, path: str = "/v1/completions", headers: dict | None = None):
    """(status, parsed body or the raw text of a stream) of one POST."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = raw(url, "POST", path, payload, {**JSON, **(headers or {})})
    try:
        return status, json.loads(answer)
    except ValueError:
        return status, answer.decode()


def spy_on_encode(monkeypatch, tokenizer) -> list[int]:
    """The lengths of the texts ``tokenizer.encode`` is given from now on (the test's end restores it)."""
    asked: list[int] = []
    encode = tokenizer.encode

    def spy(text: str, add_bos: bool = True) -> list[int]:
        asked.append(len(text))
        return encode(text, add_bos)

    monkeypatch.setattr(tokenizer, "encode", spy)
    return asked


def test_a_long_forced_run_is_scored_over_bounded_rounds_and_metrics_stay_bounded(served, monkeypatch):
    """D1, D3: a ``const`` of ~300 forced tokens is drafted at most ROUND_TOKENS a round (it was one forward
    of all of them); the answer is constrained greedy decoding's; /metrics has a series for draft positions
    1..POSITIONS-1 and one for the rest (it had one per position: 1.9 MB after one long run)."""
    url, server = served
    scored: list[int] = []
    score = SpeculativeEngine._score

    def recording(engine, rounds):
        scored.extend(len(rnd.tokens) for rnd in rounds if not rnd.chunk)
        return score(engine, rounds)

    monkeypatch.setattr(SpeculativeEngine, "_score", recording)
    status, answer = post(url, {**GOOD, "max_tokens": 400, "temperature": 0, **const_format(LONG)})
    assert status == 200 and json.loads(answer["choices"][0]["text"]) == LONG
    assert max(scored) <= ROUND_TOKENS < answer["usage"]["completion_tokens"]
    plain = Speculator((server.default.model, server.default.tokenizer), drafter="none")
    options = GenerationOptions(k=0, max_new_tokens=400, sampling=GREEDY, constraint=const(LONG))
    assert plain.generate("Once", options).text == answer["choices"][0]["text"]
    _, _, page = raw(url, "GET", "/metrics")
    positions = {labels["position"] for name, samples in scrape(url).items() if "draft_tokens" in name
                 for _, labels, _ in samples}  # fmt: skip
    assert positions <= {*map(str, range(1, POSITIONS)), f"{POSITIONS}+"} and f"{POSITIONS}+" in positions
    assert len(page) <= 100_000


def test_a_long_const_is_never_tokenized_whole_at_each_token(stories, monkeypatch):  # noqa: F811
    """D2: llguidance asks for the tokens of all the text forced from each position on; the text handed to
    the tokenizer is bounded (it was the whole rest of the value at every token: 0.7 s a token for 500 KB),
    and the output is still the value."""
    _, (model, tokenizer) = stories
    value = (WORDS * 400).strip()  # 34 KB
    asked = spy_on_encode(monkeypatch, tokenizer)
    options = GenerationOptions(k=4, max_new_tokens=100, sampling=GREEDY, constraint=const(value))
    result = Speculator((model, tokenizer), drafter="ngram").generate("Once", options)
    assert value.startswith(result.text.removeprefix('"')) and len(result.token_ids) == 100
    assert asked and max(asked) <= 1024 < len(value)


SELF = {"$ref": "#"}  # compiles, then allows no first token ("NoExtensionBias")
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite instance


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("schema", [SELF, ENDLESS], ids=["self", "endless"])
def test_a_schema_that_cannot_start_is_a_400_before_anything_streams(served, schema, stream):
    """D6: a schema that refers only to itself, or requires itself without end, compiles, then fails in its
    first tokens; it was answered 200 and, streamed, an error event: now a 400 naming response_format."""
    url, server = served
    body = {**GOOD, "stream": stream, **const_format("x")}
    body["response_format"]["json_schema"]["schema"] = schema
    status, answer = post(url, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "response_format"
    assert "invalid JSON schema: no output can be made of it" in error["message"]
    assert (
        server.scheduler.running == 0 and client(url).completions.create(**GOOD).usage.completion_tokens == 4
    )


def test_tenants_files_are_private_and_named_under_a_secret_salt(stories, tmp_path):  # noqa: F811
    """D9: each tenant's cache file 0600 in a 0700 directory, named by an HMAC of its key under a salt made
    once (0600) for the installation, not a fixed-salt hash anyone can compute from a guessed key; /metrics
    (open to all) shows no tenant's figures nor their sum."""
    root, loaded = stories
    path = tmp_path / "cache.npz"
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="suffix", api_key=("alpha", "beta"),
                          suffix_cache_file=str(path), k="4")  # fmt: skip
    server = Server(config, loaded=loaded)
    with serving(server) as url:
        assert client(url, "alpha").completions.create(**GOOD).usage.completion_tokens == 4
        assert not [name for name in scrape(url) if "suffix_cache" in name]
    directory = tenants_dir(path)
    salt = (directory / "salt").read_bytes()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and len(salt) == 32
    files = sorted(directory.iterdir())
    assert [f.name for f in files] == sorted(
        [*(f"{tenant_id(k, salt)}.npz" for k in ("alpha", "beta")), "salt"]
    )
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert installation_salt(directory) == salt  # the next server names them alike
    old = __import__("hashlib").sha256(b"verispec-tenant\0alpha").hexdigest()[:16]
    assert not any(old in f.name for f in files)


def test_serve_passes_allow_drafters_to_the_server(monkeypatch):
    """D10: ``--allow-drafters a,b`` reaches the server's config (the refusal: test_server.py)."""
    made = []

    def stub(config):
        made.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(app, "Server", stub)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--port", "0", "--drafter", "ngram", "--allow-drafters", "none, suffix"])
    assert made[0].allow_drafters == ("none", "suffix")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        pytest.param("k", int("9" * 4000), f"k must be at most {MAX_K}", id="k-of-4000-digits"),
        pytest.param("k", MAX_K + 1, f"k must be at most {MAX_K}", id="k-above"),
        pytest.param("k", "99999", f"k must be at most {MAX_K}", id="k-as-text"),
        pytest.param("top_k", int("9" * 4000), "top_k must be at most 512, the vocabulary", id="top_k-4000"),
        pytest.param("top_k", 513, "top_k must be at most 512", id="top_k-above"),
    ],
)
def test_k_and_top_k_are_bounded_and_never_echoed(served, field, value, message):
    """D11: ``k`` at most MAX_K, ``top_k`` at most the vocabulary: a 400 naming the field, the value not
    echoed (a 4,000-digit k was)."""
    url, _ = served
    body = json.dumps({**GOOD, field: value}).encode()  # json.dumps writes an integer of any length
    status, answer = post(url, body)
    assert status == 400 and answer["error"]["param"] == field and message in answer["error"]["message"]
    assert "9999" not in answer["error"]["message"].replace(str(MAX_K), "")


def test_a_prompt_too_long_by_its_bytes_is_refused_before_it_is_tokenized(served, monkeypatch):
    """D12: a prompt of more bytes than the context's tokens can spell is refused without tokenizing it (a
    3.9 MB prompt took 3.5-6 s of CPU first); one within the bound is tokenized as ever."""
    url, server = served
    asked = spy_on_encode(monkeypatch, server.default.tokenizer)
    too_long = "x" * 100_000  # stories260K: 512 tokens of at most 7 bytes (28 with SHRINK): 14,336 bytes
    chat = {"model": "stories260K", "messages": [{"role": "user", "content": too_long}]}
    for path, body in (("/v1/completions", {**GOOD, "prompt": too_long}), ("/v1/chat/completions", chat)):
        status, answer = post(url, body, path)
        assert status == 400 and "the context holds 512 tokens" in answer["error"]["message"], answer
    assert asked == []
    assert post(url, GOOD)[0] == 200 and asked  # a prompt within the bound: tokenized as ever


def test_openai_s_name_bearer_in_any_case_and_both_token_limits(stories):  # noqa: F811
    """D13: ``messages[].name`` is accepted (stories260K has no chat template: that is what refuses the
    request, not the field); the Authorization scheme in any case; ``max_tokens`` and
    ``max_completion_tokens`` together only with one value."""
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="none", api_key="sesame")
    with serving(Server(config, loaded=loaded)) as url:
        for header in ("bearer sesame", "BEARER  sesame", "Bearer sesame"):
            assert post(url, GOOD, headers={"authorization": header})[0] == 200, header
        for header in ("Basic sesame", "bearer", "sesame", "bearer sesamex"):
            assert post(url, GOOD, headers={"authorization": header})[0] == 401, header
        key = {"authorization": "Bearer sesame"}
        chat = {"model": "stories260K", "messages": [{"role": "user", "content": "hi", "name": "ann"}]}
        status, answer = post(url, chat, "/v1/chat/completions", key)
        assert status == 400 and "no chat template" in answer["error"]["message"], answer
        status, answer = post(url, {**GOOD, "max_tokens": 4, "max_completion_tokens": 5}, headers=key)
        assert status == 400 and answer["error"]["message"] == (
            "max_tokens and max_completion_tokens differ: give one of them"
        )
        status, answer = post(url, {**GOOD, "max_tokens": 3, "max_completion_tokens": 3}, headers=key)
        assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_the_stream_s_usage_chunk_carries_the_verispec_object(served):
    """docs/server.md: the last chunk of a stream carries usage and the verispec object (it had usage
    alone)."""
    url, _ = served
    chunks = list(client(url).completions.create(**GOOD, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    spec = last.model_extra["verispec"]
    assert spec["drafter"] == "ngram" and spec["target_calls"] >= 1


def test_secret_files_get_the_mode_asked_for(tmp_path):
    """files.atomic_write's mode: a secret is 0600 from its temporary file on, an existing file's wider mode
    replaced; without one, plain open()'s permissions as ever."""
    from verispec.files import atomic_write

    plain = atomic_write(tmp_path / "plain", "x")
    secret = tmp_path / "secret"
    secret.write_text("old")
    os.chmod(secret, 0o644)
    atomic_write(secret, b"new", mode=0o600)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.read_bytes() == b"new"
    assert stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_bound_on_k_is_what_a_round_scores():
    """options keeps MAX_K apart from the engine (which loads torch) so that every door checks k first."""
    from verispec.engine.engine import ROUND_TOKENS

    assert MAX_K == ROUND_TOKENS


def test_a_schema_over_the_servers_bytes_is_a_400_and_the_server_goes_on(served, monkeypatch):
    """D2's memory: llguidance's lexer takes ~250 bytes per byte of a long literal (a 500 KB ``const``:
    120-180 MB for one request), so a schema over ``MAX_SCHEMA_BYTES`` is a 400 naming response_format
    before any grammar is built (a request's tools alike, naming tools); one within it is served, and so is
    the next request."""
    url, _ = served
    monkeypatch.setattr(schema_module, "MAX_SCHEMA_BYTES", 200)
    fits, over = "a" * 60, "a" * 200
    status, answer = post(url, {**GOOD, "max_tokens": 4, "temperature": 0, **const_format(over)})
    assert status == 400 and answer["error"]["param"] == "response_format"
    assert "over this server's 200" in answer["error"]["message"], answer
    tool = {"type": "function", "function": {"name": "f", "parameters": {"const": over}}}
    chat = {"model": GOOD["model"], "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    status, answer = post(url, chat, "/v1/chat/completions")
    assert status == 400 and answer["error"]["param"] == "tools", answer
    assert "over this server's 200" in answer["error"]["message"], answer
    status, answer = post(url, {**GOOD, "max_tokens": 100, "temperature": 0, **const_format(fits)})
    assert status == 200 and json.loads(answer["choices"][0]["text"]) == fits


def test_the_server_makes_the_grammars_tokenizer_at_start(stories, monkeypatch):  # noqa: F811
    """D1's memory and wait: llguidance's view of the tokenizer (20 MB and 0.6 s for SmolLM2) is made as the
    server starts, not inside its first constrained request; the server holds glibc's mmap threshold."""
    root, loaded = stories
    monkeypatch.setattr(tokens_module, "_MADE", weakref.WeakKeyDictionary())
    held: list[bool] = []
    monkeypatch.setattr(app, "return_large_frees", lambda: held.append(True))
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="ngram", max_batch=1, k="4")
    server = Server(config, loaded=loaded)
    try:
        assert server.default.tokenizer in tokens_module._MADE
        assert held == [True]  # and its large freed buffers go back to the system (the test below)
    finally:
        server.close()


_FREED = """
import sys
from verispec.server.config import return_large_frees
def rss():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) // 1024
if sys.argv[1] == "held":
    assert return_large_frees()
block = bytearray(24 << 20); del block  # freed from mmap: glibc's threshold rises to its size
before = rss()
block = bytearray(24 << 20); del block
print(rss() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_servers_large_freed_buffers_go_back_to_the_system():
    """D1's memory: a server's process (Server calls return_large_frees) gives a large buffer back to the
    system when it is freed; glibc's default keeps it, once a block that size has been freed before."""
    freed = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", _FREED, mode], capture_output=True, text=True, check=True, timeout=60
            ).stdout
        )  # fmt: skip
        for mode in ("default", "held")
    }
    assert freed["default"] >= 20 and freed["held"] <= 2, freed
