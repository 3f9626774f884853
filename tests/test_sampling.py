"""Unit tests for :mod:`verispec.sampling`: SamplingParams validation and probs_from_logits.

probs_from_logits is checked on hand-built logits for each transform (temperature, top-k, top-p, min-p), for
the fixed order of the transforms, for invalid inputs, and against a plain-Python reference on random inputs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats
from torch import Tensor

from verispec.options import SamplingParams
from verispec.sampling import draft_draw, first_argmax, position_draws, probs_from_logits, sample

NEG_INF = float("-inf")


def logits_of(probs: list[float], dtype=torch.float64) -> Tensor:
    """Logits [V] whose softmax is ``probs`` (0 gives -inf)."""
    return torch.tensor([math.log(x) if x > 0 else NEG_INF for x in probs], dtype=dtype)


def support(probs: Tensor) -> list[int]:
    return (probs > 0).nonzero().flatten().tolist()


# ------------------------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"temperature": 3.5e38}, "temperature"),  # infinite in float32: a masked token's -inf / inf is NaN
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"min_p": False}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"invariant": 1}, "invariant"),
        ({"invariant": "yes"}, "invariant"),
    ],
)
def test_params_invalid_values_raise_one_line_value_error(kwargs, field):
    """Each invalid value raises ValueError with a one-line message naming the field and the value."""
    with pytest.raises(ValueError, match=f"^{field} ") as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert repr(next(iter(kwargs.values()))) in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 0.999},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"invariant": True},
        {"temperature": 3.4e38},
        {"top_p": 5e-324},
    ],
)
def test_params_boundary_values_are_valid(kwargs):
    """The documented boundary values are accepted and stored unchanged."""
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_params_defaults_and_frozen():
    """Defaults disable every transform; the dataclass is frozen."""
    params = SamplingParams()
    values = (params.temperature, params.top_k, params.top_p, params.min_p, params.seed, params.invariant)
    assert values == (1.0, 0, 1.0, 0.0, None, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.seed = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.invariant = True  # type: ignore[misc]


def test_a_seed_means_invariant_draws_unless_opted_out():
    """One default: invariant draws exactly when a seed is given; ``invariant=False`` opts out, and
    ``invariant=True`` without a seed stays so."""
    assert SamplingParams(seed=3).invariant is True and SamplingParams(seed=0).invariant is True
    assert SamplingParams().invariant is False
    assert SamplingParams(seed=3, invariant=False).invariant is False
    assert SamplingParams(invariant=True).invariant is True
    assert dataclasses.replace(SamplingParams(), seed=4).invariant is False  # replace: the resolved value
    halved = SamplingParams(temperature=0.5)
    assert halved.with_seed(4) == SamplingParams(temperature=0.5, seed=4, invariant=True)
    assert SamplingParams(seed=1).with_seed(None).invariant is False
    assert SamplingParams(invariant=False).with_seed(4).invariant is False  # an opt-out stays one
    assert SamplingParams(seed=1, invariant=False).with_seed(4).invariant is False


def test_params_greedy():
    """greedy is exactly temperature == 0."""
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-9).greedy and not SamplingParams().greedy


def test_params_generator_determinism():
    """A seeded generator is reproducible and fresh on each call; different seeds or seed=None differ."""
    a, b = SamplingParams(seed=42).generator(), SamplingParams(seed=42).generator()
    assert isinstance(a, torch.Generator)
    assert torch.equal(torch.rand(16, generator=a), torch.rand(16, generator=b))
    params = SamplingParams(seed=42)
    first = torch.rand(16, generator=params.generator())
    assert torch.equal(first, torch.rand(16, generator=params.generator()))  # a new generator each call
    assert not torch.equal(first, torch.rand(16, generator=SamplingParams(seed=43).generator()))
    unseeded = SamplingParams()
    x, y = torch.rand(16, generator=unseeded.generator()), torch.rand(16, generator=unseeded.generator())
    assert not torch.equal(x, y)
    assert SamplingParams(seed=7).generator("cpu").device == torch.device("cpu")


# -------------------------------------------------------------------------------------- greedy, temperature


def test_temperature_zero_is_one_hot_at_first_argmax():
    """Temperature 0: a point mass on the first index of the largest logit; filters are irrelevant."""
    logits = torch.tensor([[1.0, 3.0, 3.0, NEG_INF], [NEG_INF, -2.0, -5.0, -2.0]])  # [2, 4]
    want = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    filtered = SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.5)
    for params in (SamplingParams(temperature=0), filtered):
        probs = probs_from_logits(logits, params)
        assert probs.dtype == torch.float32
        assert torch.equal(probs, want)


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.5, 10.0])
def test_temperature_scaling_is_softmax_of_scaled_logits(temperature):
    """Without filters, probs = softmax(logits / T)."""
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # [3, 11]
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, (logits / temperature).softmax(-1))


def test_temperature_one_is_plain_softmax_and_keeps_neg_inf_at_zero():
    """-inf logits are allowed and get probability exactly 0."""
    logits = torch.tensor([0.0, NEG_INF, 1.0, NEG_INF])  # [4]
    probs = probs_from_logits(logits, SamplingParams())
    assert probs[1] == 0 and probs[3] == 0
    torch.testing.assert_close(probs, torch.tensor([0.0, NEG_INF, 1.0, NEG_INF]).softmax(-1))


@pytest.mark.parametrize("temperature", [1e-38, 1e-300])
@pytest.mark.parametrize("logits", [[5.0, 10.0], [-5.0, -10.0]])
def test_tiny_temperature_is_near_greedy_not_nan(logits, temperature):
    """A tiny positive temperature gives the greedy point mass (up to rounding), never NaN."""
    probs = probs_from_logits(torch.tensor(logits), SamplingParams(temperature=temperature))  # [2] float32
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, probs_from_logits(torch.tensor(logits), SamplingParams(temperature=0)))


# ---------------------------------------------------------------------------------------------- top-k


def test_top_k_keeps_k_most_likely():
    """top_k = 2 keeps the two largest logits and renormalizes them."""
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0], dtype=torch.float64)  # [5]
    probs = probs_from_logits(logits, SamplingParams(top_k=2))
    assert support(probs) == [1, 3]
    torch.testing.assert_close(probs[[1, 3]], torch.tensor([4.0, 3.0], dtype=torch.float64).softmax(-1))


def test_top_k_keeps_ties_at_kth_value():
    """Ties at the k-th largest value are all kept (top_k = 2 with values 3, 2, 2 keeps three tokens);
    likewise top_k = 1 with a tied maximum keeps every tied token, unlike temperature 0."""
    probs = probs_from_logits(torch.tensor([3.0, 2.0, 2.0, 1.0]), SamplingParams(top_k=2))
    assert support(probs) == [0, 1, 2]
    probs = probs_from_logits(torch.tensor([3.0, 1.0, 3.0]), SamplingParams(top_k=1))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.0, 0.5]))


def test_top_k_one_below_vocab_drops_the_least_likely():
    """top_k = V - 1 drops exactly the least likely token."""
    probs = probs_from_logits(torch.tensor([1.0, 4.0, 2.0, 3.0]), SamplingParams(top_k=3))
    assert support(probs) == [1, 2, 3]


@pytest.mark.parametrize("top_k", [0, 4, 5, 100])
def test_top_k_zero_or_at_least_vocab_keeps_all(top_k):
    """top_k = 0 or top_k ≥ V changes nothing."""
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0])  # [4]
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(top_k=top_k)), logits.softmax(-1))


def test_top_k_with_neg_inf_logits():
    """top_k larger than the number of finite logits keeps just the finite ones."""
    probs = probs_from_logits(torch.tensor([NEG_INF, 1.0, NEG_INF, 0.0]), SamplingParams(top_k=3))
    assert support(probs) == [1, 3]


# ---------------------------------------------------------------------------------------------- top-p


def test_top_p_keeps_smallest_prefix_reaching_top_p():
    """probs 0.4, 0.3, 0.2, 0.1: top_p 0.65 needs the two largest, 0.75 three, 0.35 only the largest."""
    logits = logits_of([0.1, 0.4, 0.2, 0.3])  # [4], sorted order 1, 3, 2, 0
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.35))) == [1]
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.65))) == [1, 3]
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.75))) == [1, 2, 3]
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.95))) == [0, 1, 2, 3]
    probs = probs_from_logits(logits, SamplingParams(top_p=0.65))
    torch.testing.assert_close(probs[[1, 3]], torch.tensor([4 / 7, 3 / 7], dtype=torch.float64))


def test_top_p_exact_boundary():
    """Four equal tokens (each exactly 0.25): a prefix whose mass equals top_p exactly is enough (0.5 keeps
    2), a hair more needs the next token (3); ties are broken by index (the first tokens are kept)."""
    logits = torch.zeros(4)  # [4]
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.5))) == [0, 1]
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.5 + 1e-6))) == [0, 1, 2]
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.25))) == [0]


def test_top_p_one_keeps_all_and_tiny_top_p_keeps_argmax():
    """top_p = 1 keeps every token (even a very unlikely one), 0.9999 drops the far tail; a tiny top_p keeps
    only the argmax."""
    logits = torch.tensor([0.0, 30.0, -30.0, 29.0])  # [4]
    assert support(probs_from_logits(logits, SamplingParams(top_p=1.0))) == [0, 1, 2, 3]
    near_one = probs_from_logits(logits, SamplingParams(top_p=0.9999))  # the two tail tokens have < 1e-13
    assert support(near_one) == [1, 3]
    tiny = probs_from_logits(logits, SamplingParams(top_p=1e-9))
    assert torch.equal(tiny, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    tied = probs_from_logits(torch.tensor([1.0, 5.0, 5.0]), SamplingParams(top_p=1e-9))
    assert torch.equal(tied, torch.tensor([0.0, 1.0, 0.0]))  # first of the tied maxima


@pytest.mark.parametrize("top_p", [1e-45, 1e-46, 1e-300, 5e-324])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_top_p_below_float32_s_least_value_keeps_the_argmax(top_p, dtype):
    """A top_p that is 0 in the logits' float type (below ~1e-45 in float32) keeps the most likely token, as
    transformers does, never an empty (NaN) distribution; with top-k, min-p and any temperature too."""
    logits = torch.tensor([[0.0, 3.0, -2.0, float("-inf")], [1.0, 1.0, 0.5, 0.0]], dtype=dtype)  # [2, 4]
    for temperature in (1e-300, 1e-3, 1.0, 1e30, 3.4e38):
        for top_k, min_p in ((0, 0.0), (2, 0.5)):
            params = SamplingParams(temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            probs = probs_from_logits(logits, params)
            assert torch.isfinite(probs).all()
            assert support(probs[0]) == [1] and support(probs[1]) == [0]


# ---------------------------------------------------------------------------------------------- min-p


def test_min_p_threshold_is_relative_to_max_probability():
    """probs 0.5, 0.3, 0.15, 0.05: min_p 0.2 drops below 0.1 (the 0.05), min_p 0.5 drops below 0.25."""
    logits = logits_of([0.15, 0.5, 0.05, 0.3])  # [4]
    assert support(probs_from_logits(logits, SamplingParams(min_p=0.2))) == [0, 1, 3]
    probs = probs_from_logits(logits, SamplingParams(min_p=0.5))
    assert support(probs) == [1, 3]
    torch.testing.assert_close(probs[[1, 3]], torch.tensor([0.625, 0.375], dtype=torch.float64))
    assert support(probs_from_logits(logits, SamplingParams(min_p=0.61))) == [1]


def test_min_p_keeps_the_maximum_and_ties():
    """min_p close to 1 keeps all tokens tied at the maximum and nothing else."""
    probs = probs_from_logits(torch.tensor([2.0, 1.9, 2.0]), SamplingParams(min_p=0.999))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.0, 0.5]))


# ---------------------------------------------------------------------------------------------- order


def test_order_temperature_before_top_p():
    """top-p acts on softmax(logits / T): at T = 1 probs 0.4, 0.3, ... need two tokens for top_p 0.45; at
    T = 0.25 the largest alone has more than 0.45."""
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.45))) == [0, 1]
    assert support(probs_from_logits(logits, SamplingParams(temperature=0.25, top_p=0.45))) == [0]
    # and at T = 4 (flatter) it needs the first two as well, never fewer than at T = 1
    assert support(probs_from_logits(logits, SamplingParams(temperature=4.0, top_p=0.45))) == [0, 1]


def test_order_temperature_before_min_p():
    """min-p compares probabilities after temperature: 0.3/0.4 = 0.75 at T = 1, 0.75**4 ≈ 0.32 at T = 1/4."""
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support(probs_from_logits(logits, SamplingParams(min_p=0.45))) == [0, 1, 2]
    assert support(probs_from_logits(logits, SamplingParams(temperature=0.25, min_p=0.45))) == [0]


def test_order_top_k_before_top_p():
    """top-k renormalizes before top-p: k = 2 leaves 4/7, 3/7, so top_p 0.5 keeps one token (top-p first would
    keep two: 0.4 < 0.5)."""
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support(probs_from_logits(logits, SamplingParams(top_p=0.5))) == [0, 1]
    assert support(probs_from_logits(logits, SamplingParams(top_k=2, top_p=0.5))) == [0]


def test_order_top_p_before_min_p():
    """min-p runs last: probs 0.4, 0.3, 0.15, 0.15 with top_p 0.5 and min_p 0.5 keep {0, 1} (min-p first would
    leave 4/7, 3/7 and top-p would then keep {0} alone)."""
    logits = logits_of([0.4, 0.3, 0.15, 0.15])
    params = SamplingParams(top_p=0.5, min_p=0.5)
    probs = probs_from_logits(logits, params)
    assert support(probs) == [0, 1]
    torch.testing.assert_close(probs[:2], torch.tensor([4 / 7, 3 / 7], dtype=torch.float64))


def test_all_filters_together_hand_example():
    """T = 0.5, top_k = 4, top_p = 0.9, min_p = 0.1 on five tokens, computed step by step by hand."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)  # [5]
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.1)
    s = torch.tensor([4.0, 2.0, 1.0, 0.0], dtype=torch.float64).softmax(-1)  # top-4 of logits / 0.5
    # s ≈ 0.831, 0.112, 0.041, 0.015: top_p 0.9 keeps 0, 1 (0.831 < 0.9 ≤ 0.944); min_p: 0.112/0.831 ≥ 0.1
    want = torch.zeros(5, dtype=torch.float64)
    want[:2] = s[:2] / s[:2].sum()
    torch.testing.assert_close(probs_from_logits(logits, params), want)


# ---------------------------------------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "logits",
    [
        pytest.param([[0.0, float("nan")], [0.0, 1.0]], id="nan"),
        pytest.param([[0.0, 1.0], [float("inf"), 1.0]], id="pos-inf"),
        pytest.param([[0.0, 1.0], [NEG_INF, NEG_INF]], id="row-all-neg-inf"),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_logits_raise(logits, temperature):
    """NaN, +inf and a row that is entirely -inf raise ValueError, even in one row of a batch, even greedy."""
    with pytest.raises(ValueError):
        probs_from_logits(torch.tensor(logits), SamplingParams(temperature=temperature))


@pytest.mark.parametrize(
    "logits",
    [
        pytest.param(torch.tensor([1, 2, 3]), id="integer"),
        pytest.param(torch.tensor(1.0), id="0-dim"),
        pytest.param(torch.zeros(2, 0), id="empty-vocab"),
    ],
)
def test_bad_logit_tensors_raise(logits):
    """Integer, 0-dimensional and empty-vocabulary logits raise ValueError."""
    with pytest.raises(ValueError):
        probs_from_logits(logits, SamplingParams())


def test_batched_shapes_rows_independent():
    """Logits [2, 3, 7] give probs [2, 3, 7], each row equal to the row transformed alone."""
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1))  # [2, 3, 7]
    logits[0, 1, 2] = NEG_INF
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
    probs = probs_from_logits(logits, params)
    assert probs.shape == (2, 3, 7) and probs.dtype == torch.float32
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(probs[i, j], probs_from_logits(logits[i, j], params))
    assert probs_from_logits(torch.zeros(1, 1, 1, 3), params).shape == (1, 1, 1, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_returns_float32(dtype):
    """Half-precision logits are computed and returned in float32, equal to the float32 computation."""
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(2)).to(dtype)  # [4, 9]
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.95)
    probs = probs_from_logits(logits, params)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, probs_from_logits(logits.float(), params))
    assert probs_from_logits(logits, SamplingParams(temperature=0)).dtype == torch.float32


def test_float64_stays_float64():
    """float64 logits give float64 probabilities."""
    assert probs_from_logits(torch.zeros(3, dtype=torch.float64), SamplingParams()).dtype == torch.float64
    assert probs_from_logits(torch.zeros(3, dtype=torch.float64), SamplingParams(temperature=0)).dtype == (
        torch.float64
    )


def test_input_not_modified():
    """probs_from_logits does not write into its input."""
    logits = torch.tensor([1.0, NEG_INF, 3.0, 2.0])  # [4]
    before = logits.clone()
    probs_from_logits(logits, SamplingParams(temperature=0.5, top_k=2, top_p=0.5, min_p=0.2))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------- properties


def reference(logits: list[float], params: SamplingParams) -> tuple[list[float], float]:
    """Plain-Python pipeline (float64): temperature → top-k → top-p → min-p. Also returns the distance of the
    nearest top-p / min-p decision to its threshold, so that knife-edge cases can be skipped."""
    v = len(logits)
    if params.greedy:
        best = max(range(v), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)], 1.0
    s = [x / params.temperature for x in logits]
    keep = [x != NEG_INF for x in s]
    if 0 < params.top_k < v:
        kth = sorted(s, reverse=True)[params.top_k - 1]
        keep = [k and x >= kth for k, x in zip(keep, s, strict=True)]
    margin = 1.0

    def dist(mask: list[bool]) -> list[float]:
        m = max(x for x, k in zip(s, mask, strict=True) if k)
        w = [math.exp(x - m) if k else 0.0 for x, k in zip(s, mask, strict=True)]
        total = sum(w)
        return [x / total for x in w]

    if params.top_p < 1:
        probs = dist(keep)
        order = sorted(range(v), key=lambda i: (-s[i] if keep[i] else math.inf, i))
        before = 0.0
        for i in order:
            margin = min(margin, abs(before - params.top_p))
            keep[i] = keep[i] and before < params.top_p
            before += probs[i]
    if params.min_p > 0:
        probs = dist(keep)
        floor = params.min_p * max(probs)
        for i in range(v):
            if keep[i]:
                margin = min(margin, abs(probs[i] - floor))
                keep[i] = probs[i] >= floor
    return dist(keep), margin


logit_lists = st.lists(
    st.one_of(st.floats(-8, 8, allow_nan=False), st.just(NEG_INF), st.integers(-2, 2).map(float)),
    min_size=1,
    max_size=8,
).filter(lambda xs: any(x != NEG_INF for x in xs))

param_sets = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 20)),
    top_k=st.integers(0, 9),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.99)),
)


@settings(max_examples=300, deadline=None)
@given(logits=logit_lists, params=param_sets)
def test_matches_plain_python_reference(logits, params):
    """On random logits (with ties and -inf) and parameters, probs equal a plain-Python evaluation of
    temperature → top-k → top-p → min-p (cases within 1e-9 of a top-p/min-p threshold skipped)."""
    want, margin = reference(logits, params)
    assume(margin > 1e-9)
    got = probs_from_logits(torch.tensor(logits, dtype=torch.float64), params)
    np.testing.assert_allclose(got.numpy(), np.array(want), rtol=1e-9, atol=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    logits=logit_lists,
    params=param_sets,
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_rows_are_distributions(logits, params, dtype):
    """For any valid logits and parameters: probs are ≥ 0 and sum to 1, -inf logits get 0, the first argmax
    is always kept, kept tokens form an upper set of the logits, and kept ratios are exp(Δlogit / T)."""
    x = torch.tensor(logits, dtype=torch.float64).to(dtype)  # [V]
    probs = probs_from_logits(x, params).double()
    xs = x.double()
    assert (probs >= 0).all()
    assert abs(float(probs.sum()) - 1) < 1e-5
    assert (probs[xs == NEG_INF] == 0).all()
    assert probs[int(xs.argmax())] > 0
    kept = probs > 0
    if kept.any() and not params.greedy:
        lowest_kept = float(xs[kept].min())
        clearly_above = xs > lowest_kept + 1e-5 * (1 + abs(lowest_kept))  # not equal after rounding of x / T
        assert kept[clearly_above].all()  # anything more likely than a kept token is kept
        top = int(xs.argmax())
        ratio = probs[kept] / probs[top]
        expected = ((xs[kept] - xs[top]) / params.temperature).exp()
        torch.testing.assert_close(ratio, expected, rtol=1e-4, atol=1e-6)


def test_sample_draws_each_index_with_its_weight():
    """Chi-square per row of a batch of unnormalised weights (a residual as it is), zero weights included:
    those are never drawn, and the counts fit the weights (the test fails on a sampler off by one index)."""
    weights = torch.tensor(
        [[0.0, 3.0, 0.0, 1.0, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.7]]
    )  # [3, 6]
    draws = sample(weights, torch.Generator().manual_seed(0), 20_000)  # [3, 20000]
    assert draws.shape == (3, 20_000) and draws.dtype == torch.int64
    for row, picked in zip(weights, draws, strict=True):
        counts = torch.bincount(picked, minlength=6)
        assert torch.all(counts[row == 0] == 0)
        positive = row > 0
        if int(positive.sum()) > 1:
            expected = row[positive].double().numpy() / float(row.sum()) * picked.numel()
            assert scipy_stats.chisquare(counts[positive].numpy(), expected).pvalue > 1e-4


def test_sample_is_the_generator_s_and_falls_back_on_rounding(monkeypatch):
    probs = torch.softmax(torch.randn(49_152, generator=torch.Generator().manual_seed(1)), -1)
    first = sample(probs, torch.Generator().manual_seed(7), 5)
    assert first.shape == (5,) and torch.equal(first, sample(probs, torch.Generator().manual_seed(7), 5))
    # a draw at the very top of the total (u · total rounded up to it) lands on the last index of positive
    # weight, never on the zeros after it
    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.ones(shape, dtype=torch.float64))
    assert sample(torch.tensor([0.25, 0.75, 0.0, 0.0]), torch.Generator()).tolist() == [1]


@pytest.mark.parametrize(
    "weights", [torch.zeros(4), torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("inf")])]
)
def test_sample_refuses_weights_without_a_distribution(weights):
    with pytest.raises(ValueError, match="cannot sample from weights"):
        sample(weights, torch.Generator())


def position_draw_counts(weights: torch.Tensor, seeds: range, position: int = 5) -> torch.Tensor:
    """How often each id is drawn at ``position`` across ``seeds``: [V]."""
    draws = torch.cat([position_draws(weights[None], seed, [position]) for seed in seeds])
    return torch.bincount(draws, minlength=weights.shape[0])


def test_position_draws_are_a_function_of_the_seed_position_and_row_alone():
    weights = torch.softmax(torch.randn(3, 600, generator=torch.Generator().manual_seed(4)), -1)  # [3, V]
    drawn = position_draws(weights, 7, [0, 1, 50])
    assert drawn.dtype == torch.int64 and drawn.shape == (3,)
    assert torch.equal(drawn, position_draws(weights, 7, [0, 1, 50]))
    alone = [position_draws(weights[[i]], 7, [t]) for i, t in ((2, 50), (0, 0))]  # one at a time, reordered
    assert torch.equal(torch.cat(alone), drawn[[2, 0]])
    other_seeds = torch.stack([position_draws(weights, seed, [0, 1, 50]) for seed in range(8, 16)])  # [8, 3]
    assert bool((other_seeds != drawn).any())
    assert position_draws(weights[:1], 2**63 - 1, [2**40]).shape == (1,)
    longer = torch.nn.functional.pad(weights, (0, 70_000 - 600))  # [3, 70000]: more than 256 groups of ids
    assert torch.equal(position_draws(longer, 7, [0, 1, 50]), drawn)  # an id's noise is the same


def test_position_draws_draw_each_id_with_its_weight():
    """Chi-square over 4000 seeds of an unnormalised row across three groups of the race, one of them all
    zeros, with zeros inside the others: zero weights are never drawn, the counts fit the weights."""
    weights = torch.zeros(700)
    generator = torch.Generator().manual_seed(3)
    weights[:200] = torch.rand(200, generator=generator) ** 4
    weights[600:] = torch.rand(100, generator=generator) ** 4  # ids 256 .. 511: a group of zeros
    weights[[3, 40, 650]] = torch.tensor([30.0, 20.0, 25.0])  # likely ids in two groups
    weights[100:120] = 0.0
    counts = position_draw_counts(weights, range(4000))
    assert int(counts[weights == 0].sum()) == 0
    expected = weights.double() / weights.sum() * 4000
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep & (weights > 0)].sum().view(1)]).double()
    wanted = torch.cat([expected[keep], expected[~keep & (weights > 0)].sum().view(1)])
    assert scipy_stats.chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-4


def test_position_draws_are_independent_from_position_to_position():
    """Four equally likely ids over 4000 positions of one seed: every pair of neighbours as often as any."""
    weights = torch.ones(4000, 4)
    drawn = position_draws(weights, 3, range(4000))
    pairs = torch.bincount(drawn[:-1] * 4 + drawn[1:], minlength=16).double()  # [16]
    assert scipy_stats.chisquare(pairs.numpy()).pvalue > 1e-4


def test_a_draw_from_q_is_coupled_with_the_draw_from_p_at_the_same_position():
    """The same noise: q = p always draws what p draws; a q near p agrees with p far more often than
    independent draws do (Σ p q), and never more than a coupling can (Σ min(p, q))."""
    generator = torch.Generator().manual_seed(6)
    p = torch.softmax(2 * torch.randn(600, generator=generator), -1)  # [V]
    q = torch.softmax(torch.log(p) + 0.5 * torch.randn(600, generator=generator), -1)  # [V]
    seeds = range(2000)
    from_p = torch.cat([position_draws(p[None], seed, [9]) for seed in seeds])
    assert torch.equal(from_p, torch.cat([position_draws(p[None], seed, [9]) for seed in seeds]))
    agree = float(
        (from_p == torch.cat([position_draws(q[None], seed, [9]) for seed in seeds])).double().mean()
    )
    independent, best = float((p * q).sum()), float(torch.minimum(p, q).sum())
    assert independent + 0.15 < agree < best + 3 * (best * (1 - best) / 2000) ** 0.5


def test_draft_draw_is_the_generator_s_draw_or_the_position_s_own():
    generator = torch.Generator().manual_seed(2)
    q = torch.softmax(torch.randn(300, generator=generator), -1)  # [W]: a draft vocabulary of 300 ids
    ids = torch.randperm(1000, generator=generator)[:300]  # [W]: their ids in the target's vocabulary
    plain, invariant = SamplingParams(seed=4, invariant=False), SamplingParams(seed=4)
    assert torch.equal(draft_draw(q, plain.generator(), plain, 12), sample(q, plain.generator()))
    spread = torch.zeros(1000).scatter_(0, ids, q)  # [V]
    for position in range(20):
        index = draft_draw(q, invariant.generator(), invariant, position, ids)  # [1]: an index of q
        assert torch.equal(ids[index], position_draws(spread[None], 4, [position]))
    assert torch.equal(
        draft_draw(spread, invariant.generator(), invariant, 3), position_draws(spread[None], 4, [3])
    )


@pytest.mark.parametrize(
    ("weights", "positions", "message"),
    [
        (torch.ones(2, 5), [0], "need weights"),
        (torch.ones(5), [0], "need weights"),
        (torch.zeros(1, 5), [0], "cannot sample"),
    ],
)
def test_position_draws_refuse_what_they_cannot_draw(weights, positions, message):
    with pytest.raises(ValueError, match=message):
        position_draws(weights, 1, positions)


@given(
    st.lists(st.integers(-3, 3), min_size=1, max_size=40),  # few values: many ties
    st.integers(1, 4),
    st.sampled_from([torch.float16, torch.float32, torch.float64, torch.bfloat16]),
)
def test_first_argmax_is_torchs_first_maximum(values, rows, dtype):
    """first_argmax (NumPy where it can) picks torch.argmax's index in every row: the first of tied maxima,
    whatever the float type (bfloat16 through torch) and the leading shape; a NaN counts as the maximum."""
    scores = torch.tensor(values, dtype=dtype).repeat(rows, 1)  # [rows, V]
    scores[-1] = scores[-1].roll(1)  # rows differ
    got = first_argmax(scores)
    assert got.dtype == torch.int64 and torch.equal(got, scores.argmax(-1))
    assert torch.equal(first_argmax(scores[0]), scores[0].argmax())  # a single row: a 0-d index
    with_nan = scores.clone()
    with_nan[0, -1] = float("nan")
    assert int(first_argmax(with_nan)[0]) == len(values) - 1 == int(with_nan[0].argmax())
