"""``verispec serve`` on loopback: the official ``openai`` client against a server started on a free port
(stories260K for completions, SmolLM2-135M for chat), streamed == not streamed == the library ==
``verispec generate`` for one seed, greedy == plain decoding, the usage and verispec objects, a disconnect
frees its slot, a full queue answers 429, an API key, 30+ bad requests each with its status and one line
in OpenAI's error format, and /metrics read back with prometheus_client's parser. Every server binds
127.0.0.1 on a free port and stops at the end of its fixture; every client call has a timeout."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import re
import socket
import time

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from verispec import cli
from verispec.api import Speculator
from verispec.drafting.registry import AUTO as AUTO_DRAFTER
from verispec.drafting.tree import TreeShape
from verispec.engine import rounds as rounds_module
from verispec.models.registry import load_model
from verispec.options import SamplingParams
from verispec.server.app import OncePerInterval, Server, ServerConfig, listen, serving

TIMEOUT = 60  # seconds, for any one client call


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return root, load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


@pytest.fixture(scope="module")
def served(stories):
    """(base URL, Server): stories260K drafting ngram (none, as requests choose), 2 slots, a queue of 1."""
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="ngram", max_batch=2, max_queue=1,
                          allow_drafters=("none",))  # fmt: skip
    server = Server(config, loaded=loaded)
    with serving(server) as url:
        yield url, server


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body bytes) of one plain HTTP request."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def stream_text(stream) -> tuple[str, list]:
    """The text of a streamed completion and its chunks."""
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


def test_completions_streamed_or_not_equal_the_library_and_the_cli(served, stories, capsys):
    url, server = served
    root, loaded = stories
    prompt, seed = "Once upon a time", 11
    options = dict(model="stories260K", prompt=prompt, max_tokens=24, temperature=0.8, seed=seed)
    whole = client(url).completions.create(**options)
    text, chunks = stream_text(client(url).completions.create(**options, stream=True))
    assert text == whole.choices[0].text and text
    library = Speculator(loaded, drafter="ngram").generate(
        prompt, k="auto", max_new_tokens=24, sampling=SamplingParams(temperature=0.8, seed=seed)
    )
    assert text == library.text
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    argv = ["generate", prompt, "--json", "--drafter", "ngram", "--temperature", "0.8", "--seed", str(seed)]
    assert cli.main([*argv, "--max-new-tokens", "24", *model]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == text
    usage = whole.usage
    assert usage.completion_tokens == 24 and usage.prompt_tokens == len(library_prompt(loaded, prompt))
    assert whole.choices[0].finish_reason == "length" and chunks[-1].choices[0].finish_reason == "length"
    spec = whole.model_extra["verispec"]
    assert spec["drafter"] == "ngram" and spec["k"] == "auto" and spec["target_calls"] >= 1
    assert spec["tokens_per_target_call"] == pytest.approx(24 / spec["target_calls"])


def test_a_prompt_of_token_ids_is_the_text_s_own(served, stories):
    """OpenAI's completions take a prompt as token ids too (a list of them, or a list holding one)."""
    url, _ = served
    _, loaded = stories
    ids = library_prompt(loaded, "Once upon a time")
    options = dict(model="stories260K", max_tokens=12, temperature=0)
    text = client(url).completions.create(prompt="Once upon a time", **options)
    for prompt in (ids, [ids]):
        answer = client(url).completions.create(prompt=prompt, **options)
        assert answer.choices[0].text == text.choices[0].text
        assert answer.usage.prompt_tokens == len(ids)


def library_prompt(loaded, prompt: str) -> list[int]:
    return Speculator(loaded, drafter="none").encode_prompt(prompt)


def test_greedy_through_the_server_is_plain_decoding(served, stories):
    url, _ = served
    _, loaded = stories
    plain = Speculator(loaded, drafter="none").generate(
        "Tom had a red ball.", k=0, max_new_tokens=40, sampling=SamplingParams(temperature=0)
    )
    for i, (drafter, k) in enumerate((("ngram", 4), ("ngram", "auto"), ("none", 0))):
        answer = client(url).completions.create(
            model="stories260K", prompt="Tom had a red ball.", max_tokens=40, temperature=0,
            extra_body={"drafter": drafter, "k": k},
        )  # fmt: skip
        assert answer.choices[0].text == plain.text
        assert answer.model_extra["verispec"]["drafter"] == drafter
        if i:  # the same prompt again: the slot it lands in held all of it but its last token
            usage = answer.usage
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_invariant_sampling_through_the_server_is_the_target_s_own(served, stories):
    """``invariant`` (verispec's own field, true by default with a seed): a sampled answer is the target's
    own sampling with that seed, whatever the drafter and K; ``invariant: false`` opts out."""
    url, _ = served
    _, loaded = stories
    sampling = SamplingParams(temperature=0.8, seed=5, invariant=True)
    own = Speculator(loaded, drafter="none").generate(
        "Tom had a red ball.", k=0, max_new_tokens=32, sampling=sampling
    )
    for drafter, k, flag in (("ngram", 4, {}), ("ngram", "auto", {"invariant": True}), ("none", 0, {})):
        answer = client(url).completions.create(
            model="stories260K", prompt="Tom had a red ball.", max_tokens=32, temperature=0.8, seed=5,
            extra_body={"drafter": drafter, "k": k, **flag},
        )  # fmt: skip
        assert answer.choices[0].text == own.text
    opted = client(url).completions.create(
        model="stories260K", prompt="Tom had a red ball.", max_tokens=32, temperature=0.8, seed=5,
        extra_body={"drafter": "ngram", "k": 4, "invariant": False},
    )  # fmt: skip
    assert opted.choices[0].finish_reason == "length"


def test_stream_usage_stop_strings_and_models(served):
    url, _ = served
    stream = client(url).completions.create(
        model="stories260K", prompt="Once upon a time", max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, chunks = stream_text(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    stop = text.split()[3]
    stopped = client(url).completions.create(
        model="stories260K", prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)
    assert [m.id for m in client(url).models.list().data] == ["stories260K"]
    status, _, body = raw(url, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_a_client_that_disconnects_frees_its_slot(served):
    url, server = served
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    connection.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    assert server.scheduler.running == 1
    connection.close()  # mid-stream
    deadline = time.monotonic() + 10
    while server.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.scheduler.running == 0
    metrics = scrape(url)
    assert sample(metrics, "verispec_requests_total", endpoint="/v1/completions", status="499") >= 1


def test_a_full_queue_answers_429_at_once(stories):
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="none", max_batch=1, max_queue=0)
    server = Server(config, loaded=loaded)
    with serving(server) as url:
        host, port = url.removeprefix("http://").split(":")
        busy = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        body = {"model": "stories260K", "prompt": "Once", "max_tokens": 400, "stream": True}
        busy.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"}
        )
        assert busy.getresponse().readline().startswith(b"data: ")  # the one slot is taken
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError, match="try again later"):
            client(url).completions.create(model="stories260K", prompt="Once", max_tokens=5)
        assert time.monotonic() - started < 5
        busy.close()


def test_an_api_key_guards_the_v1_routes(stories):
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="none", api_key="sesame")
    with serving(Server(config, loaded=loaded)) as url:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            client(url, "wrong").completions.create(model="stories260K", prompt="Once", max_tokens=2)
        status, _, body = raw(url, "GET", "/v1/models")
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        answer = client(url, "sesame").completions.create(model="stories260K", prompt="Once", max_tokens=2)
        assert answer.usage.completion_tokens == 2
        assert raw(url, "GET", "/health")[0] == 200  # health and metrics stay open


GOOD = {"model": "stories260K", "prompt": "Once", "max_tokens": 4}


def schema_format(schema: dict, name: str = "x") -> dict:
    """A response_format asking for JSON of ``schema``."""
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    # (path, body (bytes, or an object sent as JSON), status, message fragment)
    ("/v1/completions", b"{not json", 400, "the body is not JSON"),
    ("/v1/completions", b"", 400, "the body is not JSON"),
    ("/v1/completions", b"\xff\xfe", 400, "the body is not JSON"),
    ("/v1/completions", [1, 2], 400, "must be a JSON object"),
    ("/v1/completions", "a string", 400, "must be a JSON object"),
    ("/v1/completions", {"prompt": "x"}, 400, "model: Field required"),
    ("/v1/completions", {"model": "stories260K"}, 400, "prompt: Field required"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {**GOOD, "prompt": 3}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], [3]]}, 400, "one prompt per request"),
    ("/v1/completions", {**GOOD, "prompt": [1, 100000]}, 400, "token ids must lie in [0, 512)"),
    ("/v1/completions", {**GOOD, "prompt": [1, -2]}, 400, "token ids must lie in [0, 512)"),
    ("/v1/completions", {**GOOD, "prompt": [1, "a"]}, 400, "prompt: should be str, list[str], list[int] or"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "the prompt is empty"),
    ("/v1/completions", {**GOOD, "prompt": "Once " * 3000}, 400, "the context holds"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 10**11}, 400, "do not fit: the context holds 512 tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 511}, 400, "leaving 510"),  # "Once": 2 tokens of 512
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    (
        "/v1/completions",
        b'{"model": "stories260K", "prompt": "x", "temperature": NaN}',
        400,
        "a finite number",
    ),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "min_p": 1}, 400, "min_p"),
    ("/v1/completions", {**GOOD, "seed": -5}, 400, "seed"),
    ("/v1/completions", {**GOOD, "invariant": "yes"}, 400, "invariant"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "only n = 1"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4 stop strings"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "none empty"),
    ("/v1/completions", {**GOOD, "stop": 7}, 400, "stop: should be str or list[str]"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    ("/v1/completions", {**GOOD, "drafter": "telepathy"}, 400, "is not served here"),
    ("/v1/completions", {**GOOD, "k": "lots"}, 400, "k must be"),
    ("/v1/completions", {**GOOD, "k": -1}, 400, "k: Input should be greater than or equal to 0"),
    ("/v1/completions", {**GOOD, "k": 2.5}, 400, "k: should be int or str"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt: the prompt is empty"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", CHAT, 400, "no chat template"),
    ("/v1/nowhere", GOOD, 404, "Not Found"),
    # structured output: response_format (issue 38)
    ("/v1/completions", {**GOOD, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("/v1/completions", {**GOOD, "response_format": {"type": "json_schema"}}, 400, "json_schema goes with"),
    ("/v1/completions", {**GOOD, "response_format": "json"}, 400, "response_format"),
    ("/v1/completions", {**GOOD, **schema_format({"type": "objectx"})}, 400, "invalid JSON schema"),
    ("/v1/chat/completions", {**CHAT, **schema_format({"pattern": "(["})}, 400, "invalid JSON schema"),
    ("/v1/completions", {**GOOD, **schema_format({}, name="")}, 400, "json_schema.name"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD_REQUESTS)
def test_bad_requests_get_their_status_and_one_line(served, server_log, path, body, status, message):
    url, server = served
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, headers, answer = raw(url, "POST", path, payload, {"content-type": "application/json"})
    assert got == status
    error = json.loads(answer)["error"]
    assert (
        message in error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    )
    assert set(error) == {"message", "type", "param", "code"}
    assert server.scheduler.running == 0  # nothing was left running
    assert not [r for r in server_log if r.exc_info or r.levelno >= logging.WARNING]  # nothing logged


def test_wrong_methods_and_the_server_still_serves(served):
    url, _ = served
    assert raw(url, "GET", "/v1/completions")[0] == 405
    assert client(url).completions.create(**GOOD).usage.completion_tokens == 4


def test_a_drafter_not_allowed_is_refused_naming_the_allowed_ones(served):
    """Issue 52 (D10): a request chooses among the server's own drafter and those ``--allow-drafters`` names,
    all loaded at start; any other, known to the registry or not, is a 400 naming the allowed ones, and
    nothing is loaded."""
    url, server = served
    loaded = dict(server._speculators)
    for drafter in ("telepathy", "suffix", "eagle"):
        body = json.dumps({**GOOD, "drafter": drafter}).encode()
        got, _, answer = raw(url, "POST", "/v1/completions", body, {"content-type": "application/json"})
        error = json.loads(answer)["error"]
        named = set(re.findall(r"[a-z+]+", error["message"].split("choose from", 1)[1].split("(")[0]))
        assert got == 400 and error["param"] == "drafter" and named == {AUTO_DRAFTER, "ngram", "none"}, error
    assert server._speculators == loaded


def scrape(url: str) -> dict:
    """{family name: [(sample name, labels, value)]} from /metrics, read with prometheus_client's parser."""
    status, _, body = raw(url, "GET", "/metrics")
    assert status == 200
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(body.decode())
    }


def sample(metrics: dict, name: str, **labels) -> float:
    """The sum of a metric's samples with these labels."""
    family = name.removesuffix("_total").removesuffix("_count")
    return sum(
        value
        for sample_name, have, value in metrics.get(family, [])
        if sample_name == name and all(have.get(k) == v for k, v in labels.items())
    )


def test_metrics_parse_and_count(served):
    url, _ = served
    before = scrape(url)
    answer = client(url).completions.create(
        model="stories260K", prompt="Tom had a red ball. Tom had a red ball. Tom had a", max_tokens=30,
        temperature=0, extra_body={"k": 3},
    )  # fmt: skip
    after = scrape(url)
    spec = answer.model_extra["verispec"]
    grew = lambda name, **labels: sample(after, name, **labels) - sample(before, name, **labels)  # noqa: E731
    assert grew("verispec_generated_tokens_total") == 30
    assert grew("verispec_target_calls_total") == spec["target_calls"]
    assert grew("verispec_requests_total", endpoint="/v1/completions", status="200") == 1
    assert grew("verispec_draft_tokens_drafted_total") == spec["drafted"] > 0
    assert grew("verispec_draft_tokens_accepted_total") == spec["accepted"]
    first, second = (grew("verispec_draft_tokens_drafted_total", position=p) for p in ("1", "2"))
    assert first >= second and first > 0  # a round that drafts position 2 drafted position 1
    assert grew("verispec_time_to_first_token_seconds_count") == 1
    assert grew("verispec_inter_token_latency_seconds_count") == 29
    assert {"verispec_batch_size", "verispec_queue_depth", "verispec_tokens_per_target_call"} <= set(after)


def test_serve_refuses_bad_flags_in_one_line(capsys):
    taken = listen("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        assert cli.main(["serve", "--port", str(port), "--drafter", "none"]) == 2
        assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    finally:
        taken.close()
    for flags, message in (
        (["--max-batch", "0"], "max-batch must be an integer >= 1"),
        (["--port", "70000"], "--port must be in"),
        (["--k", "many"], "k must be"),
        (["--api-key", " "], "the API key is empty"),
        (["--max-connections", "0"], "max-connections must be an integer >= 1"),
        (["--body-timeout", "0"], "body-timeout must be seconds in (0, 86400]"),
        (["--keep-alive", "nan"], "keep-alive must be seconds"),
        (["--max-body", "-1"], "max-body must be an integer >= 1"),
        (["--allow-drafters", "telepathy"], "--allow-drafters: 'telepathy' cannot be chosen by requests"),
        (["--k", "65"], "k must be at most 64"),
        (["--allow-drafters", "ngram,model"], "--allow-drafters: 'model' cannot be chosen by requests"),
    ):
        assert cli.main(["serve", "--port", "0", *flags]) == 2  # a free port: 8000 may be another's here
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_chat_completions_on_a_chat_model(smollm2):
    config = ServerConfig(target="smollm2-135m", drafter="ngram", max_batch=2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    with serving(Server(config, loaded=smollm2)) as url:
        options = dict(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
        whole = client(url).chat.completions.create(**options)
        chunks = list(client(url).chat.completions.create(**options, stream=True))
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    plain = Speculator(smollm2, drafter="none").generate(
        messages, k=0, max_new_tokens=16, chat=True, sampling=SamplingParams(temperature=0)
    )
    assert text == plain.text


@pytest.mark.slow
def test_bench_serve_runs_and_reports(shared_model, tmp_path):
    """A seconds-long bench-serve on stories260K: a child server, clients that finish or hang up, no failure,
    every disconnect freed, memory read, the engine alone on the same work."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    # the third client's first request hangs up: one at least, however slowly the server answers
    load = ["--clients", "3", "--seconds", "2", "--max-tokens", "24", "--disconnect-every", "3"]
    argv = ["bench-serve", *model, "--drafter", "ngram", *load, "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    served = result["served"]
    assert served["failures"] == 0, served["failure_examples"]
    assert served["completed"] > 0 and served["disconnects"] > 0 and served["disconnects_freed"]
    assert 0 < served["tokens"] <= 24 * served["completed"]
    assert served["rss_start_mib"] > 0 and served["rss_end_mib"] > 0 and served["ttft_p50"] > 0
    assert result["engine"]["tokens_per_second"] > 0 and result["served_over_engine"] > 0
    assert "| completed | failures |" in (tmp_path / "results.md").read_text()


# ---------------------------------------------------------------------------------------------- hardening

DEEP = b'{"model": "stories260K", "prompt": "Once", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
LONG_INT = b'{"model": "stories260K", "prompt": "Once", "ignored": ' + b"7" * 4301 + b"}"


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_log():
    """Every record the server's loggers write, uvicorn's included (it does not propagate to caplog's)."""
    kept = Kept()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "asyncio", "verispec")]
    for logger in loggers:
        logger.addHandler(kept)
    yield kept.records
    for logger in loggers:
        logger.removeHandler(kept)


def quiet(records: list[logging.LogRecord]) -> bool:
    """Nothing worth a line in the log: no traceback, no warning."""
    return not [r for r in records if r.exc_info or r.levelno >= logging.WARNING]


LONE_IN_CHAT = b'{"model": "stories260K", "messages": [{"role": "user", "content": "\\ud83d"}]}'
HOSTILE = [
    # (path, body bytes, status, message fragment): issue 36's inputs that once got a 500 and a traceback
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, 400, "not JSON (nested too deeply)"),
    ("/v1/completions", DEEP, 400, "not JSON (nested too deeply)"),
    ("/v1/completions", LONG_INT, 400, "an integer of more than 4300 digits"),
    ("/v1/completions", json.dumps({**GOOD, "k": "\u00b2"}).encode(), 400, "k must be"),
    ("/v1/completions", json.dumps({**GOOD, "k": "9" * 5000}).encode(), 400, "k must be"),
    ("/v1/completions", b'{"model": "stories260K", "prompt": "a\\ud800b"}', 400, "lone surrogate (U+D800)"),
    ("/v1/completions", b'{"model": "stories260K", "prompt": ["\\udfff"]}', 400, "lone surrogate (U+DFFF)"),
    ("/v1/completions", b'{"model": "stories260K", "prompt": "a", "stop": "\\ud800"}', 400, "lone surrogate"),
    ("/v1/chat/completions", LONE_IN_CHAT, 400, "lone surrogate"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "a"}', 404, "does not exist"),
    ("/v1/completions", b'{"model": "stories260K", "prompt": "a", "\\ud800": 1}', 400, "not a field"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "message"), HOSTILE)
def test_hostile_inputs_get_a_one_line_4xx(served, server_log, path, body, status, message):
    url, server = served
    got, headers, answer = raw(url, "POST", path, body, {"content-type": "application/json"})
    assert got == status and headers["content-type"] == "application/json"
    error = json.loads(answer)["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert quiet(server_log)
    assert server.scheduler.running == 0 and server.scheduler.failure is None


def test_top_p_below_float32_s_least_value_is_greedy_decoding(served, stories):
    """``top_p: 1e-300`` once emptied the distribution and killed the scheduler: it keeps the argmax."""
    url, server = served
    _, loaded = stories
    plain = Speculator(loaded, drafter="none").generate(
        "Tom had a red ball.", k=0, max_new_tokens=16, sampling=SamplingParams(temperature=0)
    )
    for stream in (False, True):
        answer = client(url).completions.create(
            model="stories260K", prompt="Tom had a red ball.", max_tokens=16, temperature=1, top_p=1e-300,
            stream=stream,
        )  # fmt: skip
        text = stream_text(answer)[0] if stream else answer.choices[0].text
        assert text == plain.text
    assert raw(url, "GET", "/health")[0] == 200 and server.scheduler.failure is None


def partial_body(url: str, path: str = "/v1/completions") -> None:
    """Sends headers and half a body, then hangs up."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        body = json.dumps(GOOD).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
        time.sleep(0.2)


def test_a_client_that_hangs_up_mid_body_is_a_499_and_nothing_is_logged(served, server_log):
    url, _ = served
    before = sample(scrape(url), "verispec_requests_total", endpoint="/v1/completions", status="499")
    partial_body(url)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = sample(scrape(url), "verispec_requests_total", endpoint="/v1/completions", status="499")
        if now > before:
            break
        time.sleep(0.05)
    assert now == before + 1
    assert quiet(server_log)


NOT_IMPLEMENTED = [
    ("completions", {"echo": True}, "echo"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -1.0}, "frequency_penalty"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),  # the legacy calls (tools: tests/test_tools.py)
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"extra_body": {"invented": 1}}, "invented"),
]


@pytest.mark.parametrize(("endpoint", "fields", "name"), NOT_IMPLEMENTED)
def test_fields_verispec_does_not_implement_are_refused_by_name(served, endpoint, fields, name):
    url, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client(url).chat.completions.create(**CHAT, **fields)  # type: ignore[call-overload]
        else:
            client(url).completions.create(**GOOD, **fields)  # type: ignore[call-overload]
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == name and name in error["message"]


def test_fields_that_ask_for_nothing_pass(served):
    url, _ = served
    neutral = dict(presence_penalty=0, frequency_penalty=0.0, best_of=1, echo=False, logit_bias={}, user="u1")
    assert client(url).completions.create(**GOOD, **neutral).usage.completion_tokens == 4


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_json_by_content_type_is_a_415(served, kind):
    url, _ = served
    headers = {} if kind is None else {"content-type": kind}
    status, _, body = raw(url, "POST", "/v1/completions", json.dumps(GOOD).encode(), headers)
    assert status == 415 and "application/json" in json.loads(body)["error"]["message"]
    assert raw(url, "POST", "/v1/completions", json.dumps(GOOD).encode(),
               {"content-type": "application/json; charset=utf-8"})[0] == 200  # fmt: skip


def test_metrics_label_known_routes_only(served):
    """Unknown paths share one label: /metrics stays small whatever is asked of the server."""
    url, _ = served
    for i in range(300):
        raw(url, "GET", f"/nowhere/{i}-{time.monotonic_ns()}")
    metrics = scrape(url)
    endpoints = {labels["endpoint"] for _, labels, _ in metrics["verispec_requests"]}
    assert endpoints <= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "other",
    }
    assert sample(metrics, "verispec_requests_total", endpoint="other", status="404") >= 300
    assert len(raw(url, "GET", "/metrics")[2]) < 100_000


def test_a_request_that_fails_fails_alone_and_the_batch_goes_on(served, stories, monkeypatch, caplog):
    """An internal failure of one request (injected: its transform raises) is a 500 naming it, for that
    request alone, streamed or not; the request beside it in the batch gets its own answer, and later ones
    are served."""
    url, server = served
    _, loaded = stories
    real = rounds_module.probs_from_logits

    def failing(logits, params):
        if params.temperature == 0.625:
            raise RuntimeError("injected")
        return real(logits, params)

    monkeypatch.setattr(rounds_module, "probs_from_logits", failing)
    options = dict(model="stories260K", prompt="Tom had a red ball.", max_tokens=48, seed=3)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        good = pool.submit(lambda: client(url).completions.create(**options, temperature=0.8))
        time.sleep(0.05)
        with pytest.raises(openai.InternalServerError, match="internal error: RuntimeError: injected"):
            client(url).completions.create(**options, temperature=0.625)
        streamed = client(url).completions.create(**options, temperature=0.625, stream=True)
        with pytest.raises(openai.APIError, match="internal error: RuntimeError: injected"):
            list(streamed)
        answer = good.result(timeout=TIMEOUT)
    alone = Speculator(loaded, drafter="none").generate(
        "Tom had a red ball.", k=0, max_new_tokens=48, sampling=SamplingParams(temperature=0.8, seed=3)
    )
    assert (
        answer.choices[0].text == alone.text
    )  # invariant draws: the batch and the failure beside changed nothing
    assert client(url).completions.create(**GOOD).usage.completion_tokens == 4
    assert raw(url, "GET", "/health")[0] == 200
    logged = [r for r in caplog.records if r.exc_info]
    assert logged and all(r.name == "verispec.engine.driver" for r in logged)  # the traceback, once each


class Fatal(BaseException):
    """What no handler catches: the scheduler's worker dies of it."""


def test_a_dead_scheduler_answers_503_at_once_and_health_says_so(stories, caplog):
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="none", max_batch=1)
    server = Server(config, loaded=loaded)

    def die() -> list:
        raise Fatal("worker bug")

    server.scheduler.driver.engine.step = die  # type: ignore[method-assign]
    with serving(server) as url:
        assert raw(url, "GET", "/health")[0] == 200
        with pytest.raises(openai.InternalServerError, match="internal error: Fatal"):
            client(url).completions.create(**GOOD)  # the request in flight when it died
        status, _, body = raw(url, "GET", "/health")
        assert status == 503 and "scheduler has failed (Fatal)" in json.loads(body)["error"]
        started = time.monotonic()
        status, _, body = raw(url, "POST", "/v1/completions", json.dumps(GOOD).encode(),
                              {"content-type": "application/json"})  # fmt: skip
        assert status == 503 and "restart" in json.loads(body)["error"]["message"]
        assert time.monotonic() - started < 5
    assert [r.levelname for r in caplog.records if r.name == "verispec.engine.scheduler"] == ["CRITICAL"]


@pytest.fixture(scope="module")
def strict(stories):
    """A server with tight limits: 4 connections, half-second timeouts, 2 KB bodies."""
    root, loaded = stories
    config = ServerConfig(
        target=str(root / "stories260K.bin"), drafter="none", max_connections=4, keep_alive=0.5,
        header_timeout=0.5, body_timeout=0.5, max_body=2048,
    )  # fmt: skip
    with serving(Server(config, loaded=loaded)) as url:
        yield url


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (sending nothing more)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False


def test_silent_and_slow_connections_are_closed_and_health_still_answers(strict):
    host, port = strict.removeprefix("http://").split(":")
    silent = [socket.create_connection((host, int(port)), timeout=TIMEOUT) for _ in range(12)]
    try:
        started = time.monotonic()
        assert raw(strict, "GET", "/health")[0] == 200  # beyond the cap, an idle connection gave way
        assert time.monotonic() - started < 1
        slow = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the end of its headers
        assert closed_within(slow, 5)
        assert closed_within(silent[-1], 5)  # no headers within header_timeout
    finally:
        for sock in silent:
            sock.close()


def test_slow_large_bodies_are_refused(strict):
    host, port = strict.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: 100\r\n\r\n{{".encode())  # then nothing: slower than 0.5 s
        answer = b""
        while b"took longer" not in answer and (part := sock.recv(65536)):
            answer += part
    assert answer.startswith(b"HTTP/1.1 408") and b"took longer than 0.5 s" in answer
    status, _, body = raw(
        strict, "POST", "/v1/completions", b" " * 4096, {"content-type": "application/json"}
    )
    assert status == 413 and "larger than 2048 bytes" in json.loads(body)["error"]["message"]
    assert client(strict).completions.create(**GOOD).usage.completion_tokens == 4


def test_a_repeated_log_line_is_written_once_per_interval():
    now = [0.0]
    once = OncePerInterval(interval=60, clock=lambda: now[0])
    logger = logging.getLogger("verispec.test-once")
    records = [logger.makeRecord(logger.name, logging.ERROR, "f", 1, "accept failed: %s", ("EMFILE",), None)
               for _ in range(5)]  # fmt: skip
    passed = []
    for i, record in enumerate(records):
        now[0] = [0, 1, 2, 59, 61][i]
        passed.append(once.filter(record))
    assert passed == [True, False, False, False, True]
    assert "[3 more like it held back in 60 s]" in records[-1].getMessage()
    other = logger.makeRecord(logger.name, logging.ERROR, "f", 1, "another", (), None)
    assert once.filter(other)


@pytest.mark.parametrize(("address", "warned"), [("0.0.0.0", True), ("127.0.0.1", False), ("::1", False)])
def test_serve_warns_when_reachable_without_a_key(monkeypatch, capsys, address, warned):
    from verispec.server import app

    class Stub:
        name = "stub"
        default = type("D", (), {"drafter_name": "none"})

    monkeypatch.setattr(app, "Server", lambda config: Stub())
    monkeypatch.setattr(app, "run", lambda server, sock: sock.close())
    assert cli.main(["serve", "--host", address, "--port", "0", "--drafter", "none"]) == 0
    assert ("no --api-key is set" in capsys.readouterr().err) == warned
    assert cli.main(["serve", "--host", address, "--port", "0", "--drafter", "none", "--api-key", "k"]) == 0
    assert "no --api-key" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- logprobs


def target_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the target's own log-softmax at each token's prefix, from one plain forward."""
    ids = prompt + tokens
    positions = torch.arange(len(ids) - 1).unsqueeze(0)  # [1, L - 1]
    logits = model.forward(torch.tensor([ids[:-1]]), positions, model.new_cache())[0]  # [L - 1, V]
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 :]  # [len(tokens), V]


def check_logprobs(
    reference: torch.Tensor, tokens: list[int], got: list[float], top: list[list[int]]
) -> None:
    """reference: [n, V]; each token's logprob and its likeliest alternatives' ids, most likely first."""
    assert len(got) == len(tokens) == len(reference)
    want = reference.gather(1, torch.tensor(tokens).unsqueeze(1))[:, 0]  # [n]
    assert torch.allclose(torch.tensor(got), want, atol=1e-4)
    for row, ids in zip(reference, top, strict=True):
        assert torch.allclose(row[ids], row.topk(len(ids)).values, atol=1e-4)  # the likeliest, in order


@pytest.mark.parametrize(
    ("drafter", "tree", "sampling"),
    [
        ("ngram", None, SamplingParams(temperature=0)),
        ("ngram", "2x3", SamplingParams(temperature=0)),
        ("ngram", None, SamplingParams(temperature=0.8, top_k=20, seed=3, invariant=False)),
        ("ngram", "2x3", SamplingParams(temperature=0.8, seed=4)),
        ("none", None, SamplingParams(temperature=0.8, seed=5)),
    ],
)
def test_library_logprobs_are_the_target_s_own_at_each_prefix(stories, drafter, tree, sampling):
    """Accepted, recovered and bonus tokens, chains and trees, greedy and sampled: each token's logprob is the
    target's log-softmax at its prefix (before the sampling transform), alone and in a batch."""
    _, loaded = stories
    shape = None if tree is None else TreeShape.parse(tree)
    speculator = Speculator(loaded, drafter=drafter, tree=shape)
    prompt = "Tom had a red ball. Tom had a red ball."
    options = dict(k=4, max_new_tokens=40, sampling=sampling, logprobs=3)
    result = speculator.generate(prompt, **options)
    batched = speculator.generate_batch([prompt, "Once upon a time"], slots=2, **options)[0]
    assert batched.token_ids == result.token_ids or not (sampling.greedy or sampling.invariant)
    for got in (result, batched):
        reference = target_logprobs(loaded[0], speculator.encode_prompt(prompt), got.token_ids)
        assert [x.token for x in got.logprobs] == got.token_ids
        top = [[t for t, _ in x.top] for x in got.logprobs]
        check_logprobs(reference, got.token_ids, [x.logprob for x in got.logprobs], top)
        assert all(x.top[0][1] >= x.logprob for x in got.logprobs)
    assert speculator.generate(prompt, k=4, max_new_tokens=8, sampling=sampling).logprobs == ()


def test_completions_logprobs_streamed_and_whole_are_the_target_s_own(served, stories):
    url, _ = served
    _, loaded = stories
    prompt = "Tom had a red ball."
    plain = Speculator(loaded, drafter="none").generate(
        prompt, k=0, max_new_tokens=24, sampling=SamplingParams(temperature=0)
    )
    reference = target_logprobs(loaded[0], library_prompt(loaded, prompt), plain.token_ids)
    spelled = [loaded[1].token_bytes()[t].decode() for t in plain.token_ids]
    options = dict(model="stories260K", prompt=prompt, max_tokens=24, temperature=0, logprobs=5)
    whole = client(url).completions.create(**options, extra_body={"drafter": "ngram", "k": 4})
    chunks = list(client(url).completions.create(**options, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    got = whole.choices[0].logprobs
    assert got.tokens == spelled == [t for lp in streamed for t in lp.tokens]
    assert "".join(got.tokens) == whole.choices[0].text == plain.text
    assert got.text_offset == [t for lp in streamed for t in lp.text_offset]
    assert got.text_offset == [len("".join(spelled[:i])) for i in range(len(spelled))]
    assert got.token_logprobs == pytest.approx([x for lp in streamed for x in lp.token_logprobs], abs=1e-5)
    spell = {text: i for i, text in enumerate(b.decode("utf-8", "replace") for b in loaded[1].token_bytes())}
    top = [[spell[t] for t in sorted(alts, key=alts.get, reverse=True)] for alts in got.top_logprobs]
    check_logprobs(reference, plain.token_ids, got.token_logprobs, top)
    assert all(len(alts) == 5 for alts in got.top_logprobs)
    none = client(url).completions.create(model="stories260K", prompt=prompt, max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None


def test_chat_logprobs_streamed_and_whole_are_the_target_s_own(smollm2):
    config = ServerConfig(target="smollm2-135m", drafter="ngram", max_batch=2)
    messages = [{"role": "user", "content": "Count from one to ten."}]
    plain = Speculator(smollm2, drafter="none").generate(
        messages, k=0, max_new_tokens=20, chat=True, sampling=SamplingParams(temperature=0)
    )
    prompt = Speculator(smollm2, drafter="none").encode_prompt(messages, chat=True)
    reference = target_logprobs(smollm2[0], prompt, plain.token_ids)
    spelled = [smollm2[1].token_bytes()[t] for t in plain.token_ids]
    with serving(Server(config, loaded=smollm2)) as url:
        options = dict(model="smollm2-135m", messages=messages, max_tokens=20, temperature=0)
        whole = client(url).chat.completions.create(**options, logprobs=True, top_logprobs=3)
        chunks = list(
            client(url).chat.completions.create(**options, logprobs=True, top_logprobs=3, stream=True)
        )
        bare = client(url).chat.completions.create(**options, logprobs=True)
        with pytest.raises(openai.BadRequestError) as info:
            client(url).chat.completions.create(**options, logprobs=True, top_logprobs=21)
        assert info.value.body["param"] == "top_logprobs"
    content = whole.choices[0].logprobs.content
    streamed = [
        x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content
    ]
    assert whole.choices[0].message.content == plain.text
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.text
    assert [bytes(x.bytes) for x in content] == spelled == [bytes(x.bytes) for x in streamed]
    assert [x.token for x in content] == [b.decode("utf-8", "replace") for b in spelled]
    ids = {b: i for i, b in reversed(list(enumerate(smollm2[1].token_bytes())))}
    top = [[ids[bytes(alt.bytes)] for alt in x.top_logprobs] for x in content]
    check_logprobs(reference, plain.token_ids, [x.logprob for x in content], top)
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-5)
    assert all(len(x.top_logprobs) == 3 for x in content)
    # as streamed against whole: equal to float32 rounding — the fixture's target is the fp32 (oneDNN) model,
    # whose rows move by ~1e-4 in their logits with the size of the block they are scored in, and --k auto's
    # blocks follow the timings (docs/models.md: the precision is part of the target's identity)
    assert [x.logprob for x in bare.choices[0].logprobs.content] == pytest.approx(
        [x.logprob for x in content], abs=1e-5
    )
    assert all(x.top_logprobs == [] for x in bare.choices[0].logprobs.content)


@pytest.mark.parametrize(
    ("endpoint", "fields", "name"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),
    ],
)
def test_bad_logprobs_are_refused_by_name(served, endpoint, fields, name):
    url, _ = served
    body = {**(CHAT if endpoint == "chat" else GOOD), **fields}
    status, _, answer = raw(url, "POST", f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                            json.dumps(body).encode(), {"content-type": "application/json"})  # fmt: skip
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == name and name in error["message"]
