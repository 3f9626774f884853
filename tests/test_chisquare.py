"""Statistical checks of the REAL torch verifiers, in float32, on the toy models.

The enumeration tests prove the rules exact; these check that what actually runs — drafting with
``torch.multinomial``, :func:`rejection_sample`, :func:`single_guess_sample`, :func:`greedy_verify`,
:func:`sample_verdict` — samples those rules. Each test runs ROWS independent generations of the speculative
loop in one batch until every row has 2 tokens, then compares the joint histogram of the first two tokens with
the target's exact distribution by a chi-square goodness-of-fit test (cells of expected count < 5 merged; a
count in a cell of probability 0 fails outright). Another test does the same for the number of tokens one
round emits from a fixed context.

Significance: every exact configuration must have p-value ≥ ALPHA / NUM_EXACT (Bonferroni over the exact
chi-square tests of this module), so the whole module raises a false alarm with probability < ALPHA = 1e-4;
all generators are seeded, so a run is reproducible anyway. Broken verifiers must reach p-value < the same
threshold: with ROWS = 200,000 rows and the chosen configurations (total variation > 0.1 from the target
over the first N tokens, see test_enumeration.py), their p-values underflow to 0, so these checks are not
flaky.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from scipy import stats
from torch import Tensor

from toy import (
    SETTINGS,
    VERIFIERS,
    Verifier,
    accepted_prefix_probs,
    bonus_from_last_position,
    broken_rejection,
    draft_round,
    make_pair,
    recovered_from_p,
    single_threaded,
    speculative_loop,
    target_joint,
    without_bonus,
)
from verispec.options import SamplingParams

ROWS = 200_000  # generations per chi-square test, all in one batch
ALPHA = 1e-4  # family-wise significance level of the module

# (family, verifier, setting, K): exact configurations checked on the first two tokens
EXACT_CASES = [
    ("generic", "rejection", "t1", 3),
    ("generic", "rejection", "combo", 2),
    ("generic", "rejection", "minp0.2", 3),
    ("disjoint", "rejection", "t0.7", 2),
    ("disjoint", "rejection", "topp0.8", 1),
    ("equal", "rejection", "t1", 4),
    ("onehot", "rejection", "t1", 3),
    ("tiny", "rejection", "t1", 4),
    ("eos", "rejection", "t1", 1),
    ("eos", "rejection", "t0.7", 3),
    ("generic", "single_guess", "t1", 2),
    ("eos", "single_guess", "t0.7", 3),
    ("onehot", "single_guess", "combo", 2),
    ("tiny", "single_guess", "topk2", 1),
]
# (family, verifier, setting, K): exact configurations checked on the tokens emitted by one round
ROUND_CASES = [
    ("generic", "rejection", "t1", 3),
    ("onehot", "rejection", "t1", 2),
    ("tiny", "rejection", "t0.7", 2),
    ("generic", "single_guess", "t1", 4),
]
# exact chi-square tests: the cases above, (c) on the first two tokens, (f)
NUM_EXACT = len(EXACT_CASES) + len(ROUND_CASES) + 2
THRESHOLD = ALPHA / NUM_EXACT
TOPP = SamplingParams(top_p=0.8)


def case_id(case: tuple) -> str:
    return "-".join(str(v) for v in case[:3]) + f"-K{case[3]}"


@functools.cache
def tables32(family: str, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """(P, Q): [V+1, V+1, V] float32 target and draft tables, by the real transform in float32."""
    pair = make_pair(family)
    return pair.target.probs(params, torch.float32), pair.draft.probs(params, torch.float32)


def exact_first_two(ptab: Tensor, eos: int | None) -> np.ndarray:
    """[(V+1)^2]: the target's exact joint distribution of its first two tokens (END = V after EOS), for the
    float32 table actually sampled from (renormalized in float64)."""
    p64 = ptab.double().numpy()
    return target_joint(p64 / p64.sum(-1, keepdims=True), 2, eos).ravel()


def histogram(tokens: Tensor, vocab: int) -> np.ndarray:
    """tokens: [B, 2] int64 in [0, V] → counts [(V+1)^2] of the pairs."""
    return np.bincount((tokens[:, 0] * (vocab + 1) + tokens[:, 1]).numpy(), minlength=(vocab + 1) ** 2)


def chisquare_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of ``observed`` counts [C] to ``probs`` [C].

    Cells with expected count < 5 are pooled into one cell (itself merged into the smallest other cell if it
    is still below 5). Any count in a cell of probability exactly 0 is impossible under the null: p-value 0.
    """
    n = observed.sum()
    probs = probs / probs.sum()
    if observed[probs == 0].any():
        return 0.0
    obs, exp = observed[probs > 0].astype(np.float64), probs[probs > 0] * n
    small = exp < 5
    if small.any():
        pooled_obs, pooled_exp = obs[small].sum(), exp[small].sum()
        obs, exp = obs[~small], exp[~small]
        if pooled_exp >= 5 or len(exp) == 0:
            obs, exp = np.append(obs, pooled_obs), np.append(exp, pooled_exp)
        else:
            i = int(np.argmin(exp))
            obs[i] += pooled_obs
            exp[i] += pooled_exp
    if len(exp) < 2:
        raise AssertionError("the reference has a single cell: a chi-square test would be vacuous")
    return float(stats.chisquare(obs, exp).pvalue)


def first_two(
    family: str,
    verify: Verifier,
    k: int,
    seed: int,
    qdraw: Tensor,
    qtold: Tensor,
    ptab: Tensor,
    rows: int = ROWS,
) -> np.ndarray:
    """Histogram [(V+1)^2] of the first two tokens of ``rows`` speculative generations."""
    generator = torch.Generator().manual_seed(seed)
    eos = make_pair(family).eos_token_id
    out = speculative_loop(qdraw, qtold, ptab, k, 2, rows, verify, generator, eos)  # [rows, 2]
    return histogram(out, ptab.shape[-1])


def round_counts(family: str, verify: Verifier, k: int, seed: int, qtab: Tensor, ptab: Tensor) -> np.ndarray:
    """Counts [K+2] of the number of tokens one round emits from the BOS context, over ROWS rows."""
    vocab = ptab.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    ctx = torch.full((ROWS, 2), vocab, dtype=torch.int64)  # [B, 2]: BOS, BOS
    draft, q, p = draft_round(ctx, k, qtab, qtab, ptab, generator)
    verdict = verify(draft, q, p, generator, None)
    return np.bincount(verdict.num_tokens.numpy(), minlength=k + 2)


def exact_round_counts(family: str, verifier: str, k: int, params: SamplingParams) -> np.ndarray:
    """[K+2]: the exact distribution of the tokens emitted by one round from BOS (no EOS in the family):
    P(s + 1 tokens) = A_s − A_{s+1}, with A_s = P(first s accepted) from the closed forms."""
    ptab, qtab = (t.double().numpy() for t in tables32(family, params))
    ptab, qtab = ptab / ptab.sum(-1, keepdims=True), qtab / qtab.sum(-1, keepdims=True)
    bos = ptab.shape[-1]
    reach = np.array([1.0, *accepted_prefix_probs((bos, bos), k, qtab, ptab, verifier), 0.0])  # [K+2]
    return np.concatenate([[0.0], reach[:-1] - reach[1:]])  # index = number of tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


# ---------------------------------------------------------------------------------------------- exact


@pytest.mark.parametrize("case", EXACT_CASES, ids=case_id)
def test_first_two_tokens_match_target(case):
    """The first two tokens of the float32 speculative loop follow the target's joint distribution
    (chi-square, ROWS rows, p ≥ ALPHA / NUM_EXACT). Two tokens span a round boundary for every K: a bonus or
    recovered token and the next round's first token, both in their right contexts."""
    family, verifier, setting, k = case
    ptab, qtab = tables32(family, SETTINGS[setting])
    counts = first_two(family, VERIFIERS[verifier], k, 1000 + k, qtab, qtab, ptab)
    pvalue = chisquare_pvalue(counts, exact_first_two(ptab, make_pair(family).eos_token_id))
    assert pvalue >= THRESHOLD, f"p-value {pvalue:.3g}"


@pytest.mark.parametrize("case", ROUND_CASES, ids=case_id)
def test_tokens_per_round_match_exact_distribution(case):
    """The number of tokens one round emits (accepted + 1) follows its exact distribution
    P(s + 1) = A_s − A_{s+1} (chi-square, ROWS rows from the BOS context)."""
    family, verifier, setting, k = case
    params = SETTINGS[setting]
    ptab, qtab = tables32(family, params)
    counts = round_counts(family, VERIFIERS[verifier], k, 2000 + k, qtab, ptab)
    pvalue = chisquare_pvalue(counts, exact_round_counts(family, verifier, k, params))
    assert pvalue >= THRESHOLD, f"p-value {pvalue:.3g}"


@pytest.mark.parametrize("family", ["generic", "disjoint", "onehot", "eos"])
def test_greedy_verify_is_token_identical_to_greedy_decoding(family: str):
    """greedy_verify on drafts sampled from q at temperature 1 emits exactly the target's greedy tokens, in
    every row and every position of an 8-token generation, whatever the draft proposed."""
    pair = make_pair(family)
    ptab, _ = tables32(family, SETTINGS["greedy"])
    _, qtab = tables32(family, SETTINGS["t1"])
    ref = target_joint(ptab.double().numpy(), 8, pair.eos_token_id)  # a point mass
    want = torch.tensor(np.unravel_index(int(ref.argmax()), ref.shape))  # [8]
    for k in (1, 3):
        generator = torch.Generator().manual_seed(k)
        eos = pair.eos_token_id
        out = speculative_loop(qtab, qtab, ptab, k, 8, 2000, VERIFIERS["greedy"], generator, eos)  # [2000, 8]
        assert bool((out == want).all())


def test_topp_on_target_only_is_exact():
    """(f) Top-p on the target but not the draft is exact: rejection sampling is exact for any q it is told
    truthfully. The first two tokens follow the top-p target (chi-square)."""
    p_topp, _ = tables32("generic", TOPP)
    _, q_raw = tables32("generic", SETTINGS["t1"])
    counts = first_two("generic", VERIFIERS["rejection"], 2, 3000, q_raw, q_raw, p_topp)
    pvalue = chisquare_pvalue(counts, exact_first_two(p_topp, None))
    assert pvalue >= THRESHOLD, f"p-value {pvalue:.3g}"


# ---------------------------------------------------------------------------------------------- broken


def test_broken_recovered_from_p_is_caught():
    """(a) Recovered tokens resampled from p instead of the residual: rejected by the chi-square test."""
    ptab, qtab = tables32("onehot", SETTINGS["t1"])
    counts = first_two("onehot", broken_rejection(recovered_from_p), 1, 4000, qtab, qtab, ptab)
    assert chisquare_pvalue(counts, exact_first_two(ptab, None)) < THRESHOLD


def test_broken_bonus_distribution_is_caught():
    """(b) Bonus token sampled from p_K instead of p_{K+1}: rejected by the chi-square test."""
    ptab, qtab = tables32("equal", SETTINGS["t1"])
    counts = first_two("equal", broken_rejection(bonus_from_last_position), 1, 4001, qtab, qtab, ptab)
    assert chisquare_pvalue(counts, exact_first_two(ptab, None)) < THRESHOLD


def test_dropped_bonus_keeps_output_exact_but_is_caught_per_round():
    """(c) Dropping the bonus token leaves the output distribution exact — the stateless loop resamples that
    position from p_{K+1} in the next round — so the first-two-token test passes; but the number of tokens
    per round loses its top value (K + 1), which the per-round chi-square test catches."""
    ptab, qtab = tables32("generic", SETTINGS["t1"])
    broken = without_bonus(VERIFIERS["rejection"])
    counts = first_two("generic", broken, 1, 4002, qtab, qtab, ptab)
    assert chisquare_pvalue(counts, exact_first_two(ptab, None)) >= THRESHOLD

    counts = round_counts("generic", broken, 2, 4003, qtab, ptab)
    assert chisquare_pvalue(counts, exact_round_counts("generic", "rejection", 2, SETTINGS["t1"])) < THRESHOLD


@pytest.mark.parametrize(("draw", "told"), [("topp", "raw"), ("raw", "topp")], ids=lambda v: f"q-{v}")
def test_transform_mismatch_is_caught(draw: str, told: str):
    """(d) The draft samples from one transform of q, the verifier is told the other: rejected by chi-square
    against the top-p target."""
    p_topp, q_topp = tables32("generic", TOPP)
    _, q_raw = tables32("generic", SETTINGS["t1"])
    q = {"topp": q_topp, "raw": q_raw}
    counts = first_two("generic", VERIFIERS["rejection"], 2, 4004, q[draw], q[told], p_topp)
    assert chisquare_pvalue(counts, exact_first_two(p_topp, None)) < THRESHOLD


def test_topp_on_draft_only_is_caught():
    """(e) Top-p on the draft but not on the target: the loop samples the untransformed target, rejected by
    chi-square against the top-p target."""
    p_topp, q_topp = tables32("generic", TOPP)
    p_raw, _ = tables32("generic", SETTINGS["t1"])
    counts = first_two("generic", VERIFIERS["rejection"], 2, 4005, q_topp, q_topp, p_raw)
    assert chisquare_pvalue(counts, exact_first_two(p_topp, None)) < THRESHOLD


# ---------------------------------------------------------------------------------------------- determinism


def _generate(verifier: str, seed: int, family: str = "eos") -> Tensor:
    ptab, qtab = tables32(family, SETTINGS["t1"])
    generator = torch.Generator().manual_seed(seed)
    return speculative_loop(
        qtab, qtab, ptab, 3, 8, 512, VERIFIERS[verifier], generator, make_pair(family).eos_token_id
    )  # [512, 8]


@pytest.mark.parametrize("verifier", ["rejection", "single_guess", "greedy"])
def test_same_seed_same_tokens(verifier: str):
    """The generator is the only source of randomness: the same seed gives the same tokens over a whole
    8-token loop (drafts, accept decisions, recovered and bonus tokens)."""
    assert torch.equal(_generate(verifier, 7), _generate(verifier, 7))


@pytest.mark.parametrize("verifier", ["rejection", "single_guess"])
def test_different_seeds_different_tokens(verifier: str):
    """Different seeds give different tokens (the verifier really samples from the generator)."""
    assert not torch.equal(_generate(verifier, 7), _generate(verifier, 8))


def test_greedy_ignores_the_seed():
    """Greedy verification's output does not depend on the seed, only the drafts do."""
    assert torch.equal(_generate("greedy", 7), _generate("greedy", 8))
