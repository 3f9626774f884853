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
            method(["Once"] if method is spec.generate_batch else "Once", max_length=8)
    assert spec.generate("Once", max_new_tokens=8).stats["new_tokens"] == 8  # greedy by default


@pytest.mark.parametrize("device", ["cuda:99", "mps:3", "nonsense"])
def test_a_device_not_on_this_machine_is_a_usage_error(device):
    with pytest.raises(UsageError, match="^(device|unknown device)"):
        verispec.Speculator(device=device)  # before any model loads
