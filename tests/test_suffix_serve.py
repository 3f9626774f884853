"""The server's suffix caches (verispec.server.tenants) on 127.0.0.1 with the openai client: one cache per
API key, never shared unless ``share_suffix_cache``; greedy output == ``none``'s; the caches saved at
shutdown, one file per tenant named by an HMAC of its key under the installation's secret salt (never the
key), readable by the server's user alone, loaded by the next server; their stats not in /metrics; ``serve``
refusing a cache flag with a drafter that has none, in one line."""

from __future__ import annotations

import json

import pytest

from test_server import client, scrape, stories  # noqa: F401 - stories: the fixture
from verispec import cli
from verispec.api import Speculator
from verispec.drafting.suffix_cache import SuffixCache
from verispec.options import SamplingParams
from verispec.server.app import Server, ServerConfig, serving
from verispec.server.tenants import installation_salt, tenant_id, tenants_dir

PROMPTS = ["Once upon a time", "The little dog"]


def complete(url: str, key: str, prompt: str) -> str:
    answer = client(url, key).completions.create(
        model="stories260K", prompt=prompt, max_tokens=20, temperature=0
    )
    return answer.choices[0].text


def test_tenants_keep_apart_and_their_caches_survive_a_restart(stories, tmp_path):  # noqa: F811
    root, loaded = stories
    path = tmp_path / "cache.npz"
    config = ServerConfig(
        target=str(root / "stories260K.bin"), drafter="suffix", api_key=("alpha", "beta"),
        suffix_cache_file=str(path), k="4",
    )  # fmt: skip
    plain = Speculator(loaded, drafter="none")
    greedy = SamplingParams(temperature=0)
    expected = [plain.generate(p, max_new_tokens=20, sampling=greedy).text for p in PROMPTS]
    server = Server(config, loaded=loaded)
    alpha, beta = (server.tenants.tenant(key) for key in ("alpha", "beta"))
    with serving(server) as url:
        assert [complete(url, "alpha", p) for p in PROMPTS] == expected
        assert complete(url, "alpha", PROMPTS[0]) == expected[0]  # warm
        assert server.tenants.caches[alpha].stats()["sequences"] == 3
        assert server.tenants.caches[beta].stats()["sequences"] == 0  # alpha's outputs are not beta's
        assert complete(url, "beta", PROMPTS[1]) == expected[1]
        assert server.tenants.stats()["sequences"] == 4
        assert not [name for name in scrape(url) if "suffix" in name]  # the tenants' figures: nobody's
    directory = tenants_dir(path)
    assert [p.name for p in tmp_path.iterdir()] == [directory.name]
    files = sorted(p.name for p in directory.iterdir())
    assert files == sorted([f"{alpha}.npz", f"{beta}.npz", "salt"])
    assert not any("alpha" in name or "beta" in name for name in files)
    assert len(SuffixCache.load(directory / f"{alpha}.npz").sequences()) == 3
    restarted = Server(config, loaded=loaded)  # the next server starts warm, each tenant from its file
    assert restarted.tenants.caches[beta].stats()["sequences"] == 1
    restarted.close()


def test_a_shared_cache_is_one_file(stories, tmp_path):  # noqa: F811
    root, loaded = stories
    path = tmp_path / "cache.npz"
    config = ServerConfig(
        target=str(root / "stories260K.bin"), drafter="ngram", api_key=("alpha", "beta"),
        share_suffix_cache=True, allow_drafters=("suffix",),
    )  # fmt: skip
    server = Server(config, loaded=loaded)
    with serving(server) as url:  # requests naming the suffix drafter share the one cache
        for key in ("alpha", "beta"):
            answer = client(url, key).completions.create(
                model="stories260K", prompt=PROMPTS[0], max_tokens=8, extra_body={"drafter": "suffix"}
            )
            assert answer.usage.completion_tokens == 8
        assert list(server.tenants.caches) == ["shared"]
        assert server.tenants.caches["shared"].stats()["sequences"] == 2
    assert not path.exists()  # no file given: memory only


def test_serve_refuses_cache_flags_in_one_line(stories, tmp_path, capsys):  # noqa: F811
    root, _ = stories
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    corrupt = tmp_path / "c.npz"
    corrupt.write_text("junk")
    directory = tenants_dir(tmp_path / "t.npz")
    tenant = directory / f"{tenant_id('k', installation_salt(directory))}.npz"
    tenant.write_text("junk")
    for flags, message in (
        (
            ["--drafter", "ngram", "--suffix-cache", str(tmp_path / "x.npz")],
            "give --drafter suffix (not ngram)",
        ),
        (["--drafter", "suffix", "--suffix-cache", str(corrupt)], "is not a verispec suffix cache"),
        (["--drafter", "suffix", "--suffix-cache", str(tmp_path / "t.npz"), "--api-key", "k"], tenant.name),
    ):
        assert cli.main(["serve", *model, "--port", "0", *flags]) == 2  # refused before the model loads
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert corrupt.read_text() == "junk" and tenant.read_text() == "junk"


@pytest.mark.parametrize("keys", [None, "solo"])
def test_without_keys_or_with_one_there_is_one_tenant(stories, keys):  # noqa: F811
    root, loaded = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="suffix", api_key=keys)
    server = Server(config, loaded=loaded)
    expected = ["shared"] if keys is None else [server.tenants.tenant("solo")]
    assert list(server.tenants.caches) == expected
    server.close()


@pytest.mark.slow
def test_bench_serve_runs_the_suffix_drafter_warm(shared_model, tmp_path):
    """``bench-serve --drafter suffix-warm``: the server serves suffix, every prompt once through it before
    timing (the engine's run too); no failure, reported under its own name."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    load = ["--clients", "2", "--seconds", "1", "--max-tokens", "8", "--disconnect-every", "0", "--k", "4"]
    assert cli.main(["bench-serve", *model, "--drafter", "suffix-warm", *load, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["drafter"] == "suffix-warm"
    assert result["served"]["failures"] == 0 and result["served"]["completed"] > 0
    assert result["engine"]["tokens_per_target_call"] > 1  # drafts from the warm cache are accepted
