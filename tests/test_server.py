"""``verispec serve`` on loopback: the official ``openai`` client against a server started on a free port
(stories260K for completions, SmolLM2-135M for chat), streamed == not streamed == the library ==
``verispec generate`` for one seed, greedy == plain decoding, the usage and verispec objects, a disconnect
frees its slot, a full queue answers 429, an API key, 30+ bad requests each with its status and one line
in OpenAI's error format, and /metrics read back with prometheus_client's parser. Every server binds
127.0.0.1 on a free port and stops at the end of its fixture; every client call has a timeout."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from verispec import cli
from verispec.api import Speculator
from verispec.models.registry import load_model
from verispec.sampling import SamplingParams
from verispec.server.app import Server, ServerConfig, listen, serving

TIMEOUT = 60  # seconds, for any one client call


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return root, load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


@pytest.fixture(scope="module")
def served(stories):
    """(base URL, Server): stories260K drafting with ngram, 2 slots and a queue of 1."""
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="ngram", max_batch=2, max_queue=1)
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
    """``invariant`` (verispec's own field): a sampled answer is the target's own sampling with that seed,
    whatever the drafter and K."""
    url, _ = served
    _, loaded = stories
    sampling = SamplingParams(temperature=0.8, seed=5, invariant=True)
    own = Speculator(loaded, drafter="none").generate(
        "Tom had a red ball.", k=0, max_new_tokens=32, sampling=sampling
    )
    for drafter, k in (("ngram", 4), ("ngram", "auto"), ("none", 0)):
        answer = client(url).completions.create(
            model="stories260K", prompt="Tom had a red ball.", max_tokens=32, temperature=0.8, seed=5,
            extra_body={"drafter": drafter, "k": k, "invariant": True},
        )  # fmt: skip
        assert answer.choices[0].text == own.text


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
CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    # (path, body (bytes, or an object sent as JSON), status, message fragment)
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"", 400, "not valid JSON"),
    ("/v1/completions", b"\xff\xfe", 400, "not valid JSON"),
    ("/v1/completions", [1, 2], 400, "must be a JSON object"),
    ("/v1/completions", "a string", 400, "must be a JSON object"),
    ("/v1/completions", {"prompt": "x"}, 400, "model: Field required"),
    ("/v1/completions", {"model": "stories260K"}, 400, "prompt: Field required"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {**GOOD, "prompt": 3}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "the prompt is empty"),
    ("/v1/completions", {**GOOD, "prompt": "Once " * 3000}, 400, "the context holds"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "min_p": 1}, 400, "min_p"),
    ("/v1/completions", {**GOOD, "seed": -5}, 400, "seed"),
    ("/v1/completions", {**GOOD, "invariant": "yes"}, 400, "invariant"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "only n = 1"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4 stop strings"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "none empty"),
    ("/v1/completions", {**GOOD, "stop": 7}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    ("/v1/completions", {**GOOD, "drafter": "telepathy"}, 400, "is not served here"),
    ("/v1/completions", {**GOOD, "k": "lots"}, 400, "k must be"),
    ("/v1/completions", {**GOOD, "k": -1}, 400, "k"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", CHAT, 400, "no chat template"),
    ("/v1/nowhere", GOOD, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD_REQUESTS)
def test_bad_requests_get_their_status_and_one_line(served, caplog, path, body, status, message):
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
    assert not [
        r for r in caplog.records if r.exc_info or r.name.startswith("verispec")
    ]  # no traceback logged


def test_wrong_methods_and_the_server_still_serves(served):
    url, _ = served
    assert raw(url, "GET", "/v1/completions")[0] == 405
    assert client(url).completions.create(**GOOD).usage.completion_tokens == 4


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
    ):
        assert cli.main(["serve", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_model("smollm2-135m")
    except ValueError as err:  # no registry access on this machine: say so
        pytest.skip(f"SmolLM2-135M unavailable: {err}")


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
