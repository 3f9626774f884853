"""``verispec serve --ray``: two replicas of stories260K (one thread each) on one local Ray, behind Ray
Serve's proxy on a free loopback port, started once for the module on the local Ray (``local_ray``)
and always shut down. The ``openai`` client against it: answers equal to ``verispec generate``'s (greedy,
and sampled with a seed) whichever replica serves them; a session or a user back to its replica; /metrics
of both, labelled; a replica killed while its requests run: they fail in one line, the rest succeed, and
Ray Serve replaces it. Without Ray: the affinity keys, and the new flags refused before Ray or torch
loads."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import threading
import time
import types

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from verispec import cli
from verispec.server.config import ServerConfig, listen

TIMEOUT = 60  # seconds, for any one client call
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def cluster(local_ray, shared_model):
    """(base URL, stories260K's directory): 2 replicas drafting ngram, 2 slots and a queue of 16 each, on the
    local Ray; Ray Serve shut down after the module's tests."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'ray[serve]'")
    from ray import serve

    from verispec.server.config import RayDeployment
    from verispec.server.ray_serve import deploy

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    config = ServerConfig(target=str(root / "stories260K.bin"), tokenizer=str(root / "tok512.bin"),
                          drafter="ngram", k="4", max_batch=2, max_queue=16)  # fmt: skip
    try:
        with listen("127.0.0.1", 0) as probe:
            port = probe.getsockname()[1]
        yield deploy(config, RayDeployment(replicas=2, threads=1), "127.0.0.1", port), root
    finally:
        serve.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def complete(url: str, session: str | None = None, **options) -> tuple[str, str]:
    """(the replica that answered, the text) of a completion of stories260K."""
    headers = {"X-Session-Id": session} if session else {}
    raw = client(url).completions.with_raw_response.create(
        model="stories260K", **{"prompt": PROMPT, "max_tokens": 24, **options}, extra_headers=headers
    )
    return raw.headers["x-verispec-replica"], raw.parse().choices[0].text


@pytest.fixture(scope="module")
def sessions(cluster):
    """A session header that goes to each replica: replica id → session."""
    url, _ = cluster
    found: dict[str, str] = {}
    for n in range(32):  # each session lands on either replica by its hash: 2**-31 to miss one
        replica, _ = complete(url, f"s{n}", max_tokens=1)
        found.setdefault(replica, f"s{n}")
        if len(found) == 2:
            return found
    raise AssertionError(f"32 sessions all went to {set(found)}")


def generated(root, capsys, *flags: str) -> str:
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    assert cli.main(["generate", PROMPT, "--json", "--max-new-tokens", "24", *model, *flags]) == 0
    return json.loads(capsys.readouterr().out)["text"]


@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_answers_equal_generate_whichever_replica_serves(cluster, sessions, capsys):
    url, root = cluster
    greedy = generated(root, capsys, "--drafter", "none")
    sampled = generated(root, capsys, "--drafter", "none", "--temperature", "0.8", "--seed", "11")
    assert greedy != sampled
    for replica, session in sessions.items():
        assert complete(url, session, temperature=0) == (replica, greedy)
        assert complete(url, session, temperature=0.8, seed=11) == (replica, sampled)
        raw = client(url).completions.with_raw_response.create(
            model="stories260K", prompt=PROMPT, max_tokens=24, temperature=0.8, seed=11, stream=True,
            extra_headers={"X-Session-Id": session},
        )  # fmt: skip
        assert raw.headers["x-verispec-replica"] == replica
        assert "".join(chunk.choices[0].text for chunk in raw.parse()) == sampled


@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_a_session_or_a_user_comes_back_to_its_replica(cluster, sessions):
    url, _ = cluster
    for replica, session in sessions.items():
        for prompt in ("Tom had", "The sun", "Lily saw a"):
            assert complete(url, session, prompt=prompt, max_tokens=2)[0] == replica
    for user in ("ann", "bob"):
        served = {complete(url, prompt=prompt, max_tokens=2, user=user)[0] for prompt in ("Tom", "Sue", "A")}
        assert len(served) == 1


@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_metrics_are_every_replica_s_labelled(cluster, sessions):
    url, _ = cluster
    for session in sessions.values():
        complete(url, session, max_tokens=2)
    with client(url)._client as http:  # the openai client's httpx: /metrics is outside /v1
        page = http.get(f"{url}/metrics", timeout=TIMEOUT)
    assert page.status_code == 200
    families = {family.name: family for family in text_string_to_metric_families(page.text)}
    served = {
        s.labels["replica"] for s in families["verispec_requests"].samples if s.labels["status"] == "200"
    }
    assert served == set(sessions)


@pytest.mark.xdist_group("ray")  # one worker runs the group on one local Ray (local_ray)
def test_a_replica_killed_mid_run_fails_its_requests_cleanly(cluster, sessions):
    """Streams and whole answers running on a replica that is killed end at once with one message (an error
    event, a 503); the others' answers are whole; the next requests succeed, and Ray Serve starts a new
    replica."""
    from ray import serve

    from verispec.server.ray_serve import kill_replica

    url, _ = cluster
    victim, session = next(iter(sessions.items()))

    streaming = threading.Event()  # a stream's first chunk has come: requests are running

    def run(n: int) -> str:
        options = dict(model="stories260K", prompt=f"{PROMPT} {n}", max_tokens=400, temperature=0)
        headers = {"X-Session-Id": session}  # its replica's 2 slots, then the other's, then queued there
        try:
            if n % 2:
                text = ""
                for chunk in client(url).completions.create(**options, stream=True, extra_headers=headers):
                    streaming.set()
                    text += chunk.choices[0].text
            else:
                text = client(url).completions.create(**options, extra_headers=headers).choices[0].text
        except openai.APIError as err:
            assert "replica serving this request died" in err.message, err.message
            assert getattr(err, "status_code", 503) == 503
            return "failed"
        assert text
        return "whole"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        runs = [pool.submit(run, n) for n in range(8)]
        assert streaming.wait(TIMEOUT)
        kill_replica(victim)  # what bench-serve --kill-replica-at does
        outcomes = [future.result(timeout=TIMEOUT) for future in runs]
    assert "failed" in outcomes, outcomes
    for n in range(4):
        raw = client(url).completions.with_raw_response.create(
            model="stories260K", prompt=f"Tom {n}", max_tokens=4, extra_headers={"X-Session-Id": session}
        )
        text, replica = raw.parse().choices[0].text, raw.headers["x-verispec-replica"]
        assert text and replica != victim, (victim, replica, raw.http_response.text)  # the whole answer
    deadline = time.monotonic() + 120
    while True:  # a new replica, its model loaded
        deployment = serve.status().applications["verispec"].deployments["Replica"]
        if deployment.replica_states.get("RUNNING") == 2:
            break
        assert time.monotonic() < deadline, deployment
        time.sleep(1)


def test_affinity_keys():
    from verispec.server.ray_serve import affinity_key

    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    later = {"messages": [*chat["messages"], {"role": "assistant", "content": "Hello"}]}
    body = lambda fields: json.dumps(fields).encode()  # noqa: E731
    key = lambda headers, fields, tenanted=False: affinity_key(tenanted, headers, body(fields))  # noqa: E731
    assert key({}, chat) == key({}, later)  # a conversation's next turn: its replica
    assert key({}, chat) != key({}, {"messages": [{"role": "user", "content": "Hi"}]})
    bearer = {"authorization": "Bearer alpha"}
    assert key(bearer, chat, True) == key(bearer, {"prompt": "x"}, True) != key({}, chat)  # a tenant's
    assert key(bearer, chat) == key({}, chat)  # no keys served: the client's key names nobody
    assert key({}, {**chat, "user": "ann"}) == key({}, {"prompt": "x", "user": "ann"})
    session = {"x-session-id": "s1"}
    assert key(session, chat) == key(session, {"prompt": "y"}) != key({}, chat)
    assert key({}, {"prompt": "a" * 600}) == key({}, {"prompt": "a" * 512 + "b" * 88})  # a prompt's start
    assert key({}, {"prompt": [[1, 2, 3]]}) == key({}, {"prompt": [1, 2, 3]})
    assert affinity_key(False, {}, b"{not json") is None and key({}, {"model": "m"}) is None


def test_the_router_keeps_a_key_on_its_replica_unless_it_is_full():
    """The affinity router on made-up replicas and loads: a key's replica the same whatever the order; a
    replica that goes moves its own keys alone; a full replica's key to the least loaded while another has
    a free slot; a pinned request to its replica alone; no key, any replica by load."""
    import asyncio

    from verispec.server.ray_serve import PIN, AffinityRouter

    def replica(name):
        return types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id=name))

    loads: dict[str, int] = {}
    router = AffinityRouter.__new__(AffinityRouter)  # no Ray Serve: the policy alone
    router.slots = 2
    router._replica_queue_len_cache = types.SimpleNamespace(get=lambda rid: loads.get(rid.unique_id))

    def ranks(replicas, key):
        request = types.SimpleNamespace(args=[key], routing_context=types.SimpleNamespace())
        chosen = asyncio.run(router.choose_replicas(replicas, request))
        return [[r.replica_id.unique_id for r in rank] for rank in chosen]

    three = [replica(name) for name in ("a", "b", "c")]
    keys = [f"key{n}" for n in range(60)]
    first = {key: ranks(three, key)[0] for key in keys}
    assert all(len(rank) == 1 for rank in first.values()) and len({r[0] for r in first.values()}) == 3
    assert all(ranks(three[::-1], key)[0] == first[key] for key in keys)
    assert set(ranks(three, "key0")[1]) == {"a", "b", "c"} - set(first["key0"])  # then the others
    two = [r for r in three if r.replica_id.unique_id != "c"]
    for key in keys:  # c goes: its keys move, the others stay
        if first[key] != ["c"]:
            assert ranks(two, key)[0] == first[key]
    (home,) = first["key0"]
    loads.update({home: 2, **{other: 1 for other in {"a", "b", "c"} - {home}}})
    assert ranks(three, "key0") == [["a", "b", "c"]]  # all slots of its replica taken: by load
    loads.update({other: 2 for other in {"a", "b", "c"} - {home}})
    assert ranks(three, "key0")[0] == [home]  # every replica full: it queues where its caches are
    assert ranks(three, PIN + "b") == [["b"]] and ranks(three, PIN + "gone") == [[]]
    assert ranks(three, None) == [["a", "b", "c"]]


def test_a_replica_whose_scheduler_died_is_unhealthy():
    """Ray Serve replaces a replica whose ``check_health`` raises: one whose scheduler has died."""
    from verispec.server.ray_serve import Replica

    replica = Replica.__new__(Replica)  # its server alone: no model, no Ray
    scheduler = types.SimpleNamespace(failure=None)
    replica.server = types.SimpleNamespace(scheduler=scheduler, close=lambda: None)
    replica.check_health()
    scheduler.failure = MemoryError()
    with pytest.raises(RuntimeError, match=r"the scheduler has failed \(MemoryError\)"):
        replica.check_health()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--replicas", "2"], "--replicas is a Ray Serve setting: give --ray too"),
        (["--address", "auto"], "--address is a Ray Serve setting: give --ray too"),
        (["--ray", "--replicas", "0"], "--replicas must be an integer in [1, 1024], got 0"),
        (["--ray", "--address", " "], "--address is empty"),
        (["--ray", "--max-connections", "9"], "--max-connections bounds the single server's connections"),
        (
            ["--ray", "--drafter", "suffix", "--suffix-cache", "c.npz"],
            "--suffix-cache FILE: replicas keep their suffix caches",
        ),
        (["--ray", "--max-batch", "0"], "max-batch must be an integer >= 1"),
        (["--ray", "--address", "127.0.0.1:1"], "cannot reach Ray at 127.0.0.1:1"),  # a closed port
    ],
)
def test_ray_flags_refused_in_one_line_before_ray_loads(flags, message):
    code = (
        "import sys; from verispec import cli; rc = cli.main(['serve', '--port', '0', *sys.argv[1:]]); "
        "assert not {'ray', 'torch'} & set(sys.modules), 'loaded'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_exposure_warning_loads_no_torch():
    """`serve --ray` warns of an address reachable from other machines before Ray Serve starts: that check
    (server.config.exposed) is the stdlib's, so the driver process never loads torch for it."""
    code = (
        "import sys; from verispec.server.config import exposed; "
        "assert exposed('0.0.0.0') and exposed('::') and not exposed('127.0.0.1') and not exposed('::1'); "
        "assert 'torch' not in sys.modules, 'loaded'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kill-replica-at", "5"], "--kill-replica-at needs --replicas 2 or more"),
        (["--replicas", "1", "--kill-replica-at", "5"], "--kill-replica-at needs --replicas 2 or more"),
        (["--replicas", "2", "--kill-replica-at", "30"], r"must be a number of seconds in \(0, 30\), got 30"),
        (["--replicas", "2", "--kill-replica-at", "-1"], r"must be a number of seconds in \(0, 30\), got -1"),
    ],
)
def test_a_replica_killed_by_bench_serve_is_checked_before_anything_starts(capsys, flags, message):
    """bench-serve --kill-replica-at: refused in one line unless another replica answers meanwhile and the
    kill falls within the run (--seconds 30)."""
    assert cli.main(["bench-serve", "--seconds", "30", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_the_report_says_what_a_replica_s_death_did(tmp_path):
    """A killed replica's requests are counted apart from failures; each replica's answers after the kill
    (a new id: Ray Serve's replacement) come from the counts before and at the end."""
    from verispec.bench.serve import _after_kill, write_serve_report

    killed = {"replica": "a", "at": 150.04, "before": {"a": 40, "b": 38}, "message": "died"}
    after = _after_kill(killed, {"a": 41, "b": 90, "c": 30}, died=3)
    assert after == {"replica": "a", "at": 150.0, "died": 3, "answered_after": {"a": 1, "b": 52, "c": 30}}
    assert _after_kill({}, {"a": 1}, 0) is None
    served = {"completed": 160, "failures": 0, "disconnects": 2, "disconnects_freed": True,
              "tokens_per_second": 100.0, "ttft_p50": 0.1, "ttft_p99": 0.2, "itl_p50": 0.01, "itl_p99": 0.02,
              "rss_start_mib": 1.0, "rss_warm_mib": 1.0, "rss_end_mib": 1.0, "rss_max_mib": 1.0,
              "rss_growth": 0.0, "rss_growth_warm": 0.0, "cached_prompt_share": 0.5,
              "replicas": {"a": 41, "b": 90, "c": 30}, "failure_examples": [], "killed": after}  # fmt: skip
    text = (write_serve_report({"config": {}, "served": served}, tmp_path) / "results.md").read_text()
    assert "Replica a killed 150 s into the run: requests that failed with its death's one message" in text
    assert "(a 503 or an error event; the failures above are the others): 3;" in text
    assert "requests answered after it: a 1, b 52, c 30." in text
