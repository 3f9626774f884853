"""Learned drafters beside a target on the native kernels: their matrices on those kernels (q8_0, float16
where a width does not fit its blocks), close to the float32 heads they were packed from; each row of a call
computed from that row alone; the target's greedy output token for token; q the distribution each draft was
drawn from. The target: a tiny random Llama of :mod:`test_eagle`, in float16 on the native kernels."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from fakes import LetterTokenizer
from test_eagle import (
    ALPHA,
    GREEDY,
    VOCAB,
    drafter_with_context,
    first_token_chi_square,
    fresh_head,
    hidden_states,
    plain_greedy,
    tiny_target,
)
from test_lookahead import needs_native, random_lookahead
from test_medusa_exit import random_exit, random_medusa
from verispec.api import Speculator
from verispec.drafting.base import Allowed, DraftRow
from verispec.drafting.learned import eagle as eagle_module
from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.learned.eagle_drafter import EagleDrafter, EagleTreeDrafter
from verispec.drafting.learned.head import LearnedHead
from verispec.drafting.learned.medusa import MedusaDrafter
from verispec.drafting.tree import TreeShape
from verispec.engine.sequence import GenerationStats
from verispec.kernels.threads import THREADS
from verispec.models.kv_cache import native_rows
from verispec.models.llama import Llama
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits

pytestmark = needs_native
rows_of = native_rows  # what the eagle head places its rows' tokens with (counted in a test)
PROMPTS = ("abc", "hello", "qqqzzz", "the", "mnopqrs", "x")
KINDS = ("eagle", "medusa", "exit", "lookahead")


def native_tiny_target() -> Llama:
    """test_eagle's tiny random Llama in float16 on the native kernels."""
    model = tiny_target(seed=4)
    assert model.optimize_for_cpu(precision="fp16", min_weight_elements=0) and model.on_native_kernels
    return model


@pytest.fixture(scope="module")
def target() -> Llama:
    return native_tiny_target()


def random_head(target: Llama, kind: str) -> LearnedHead:
    """A random float32 head of ``kind`` for ``target`` whose drafts are sometimes accepted."""
    vocab = torch.arange(VOCAB)
    if kind == "eagle":
        return fresh_head(target, vocab, seed=2)
    if kind == "medusa":
        return random_medusa(target, vocab)
    return random_exit(target, vocab) if kind == "exit" else random_lookahead(target, vocab)


def native_copy(head: LearnedHead) -> LearnedHead:
    native = copy.deepcopy(head)
    assert native.optimize_for_cpu(native=True) and native.cpu_precision == "q8_0"
    return native


def draft_features(head: LearnedHead, features: torch.Tensor, target: Llama) -> torch.Tensor:
    """What the head's draft logits read for target features [N, H]: [N, ..., H]."""
    if isinstance(head, EagleHead):  # N tokens of one sequence, causal, after nothing
        n = features.shape[0]
        tokens = torch.arange(n)[None] % VOCAB  # [1, N]
        return head(tokens, features[None], torch.arange(n)[None], head.new_cache(1, n))[0]
    return head(features) if head.kind != "lookahead" else features


@pytest.mark.parametrize("kind", KINDS)
def test_native_heads_are_the_float32_heads_rounded(target, kind):
    """Features and draft logits of the native head within q8_0's rounding of the float32 head's; the eagle
    head's cache in the kernels' tiled float16 layout, its forwards not timed for the kernels' thread
    choice."""
    plain = random_head(target, kind)
    native = native_copy(plain)
    features = torch.randn(7, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = draft_features(plain, features, target), draft_features(native, features, target)
        torch.testing.assert_close(b, a, atol=0.03 * float(a.abs().max()), rtol=0.03)
        la, lb = plain.logits(a), native.logits(b)  # [N, ..., Vd]
    torch.testing.assert_close(lb, la, atol=0.05 * float(la.abs().max()), rtol=0.05)
    if isinstance(native, EagleHead):
        assert native.new_cache().tiled
        with two_threads():  # on one thread nothing is timed at all
            calls = THREADS.schedule.events
            with torch.no_grad():
                draft_features(native, features, target)
            assert THREADS.schedule.events == calls  # the thread count follows the target's forwards alone


@contextlib.contextmanager
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(before)


def test_only_the_targets_own_forwards_are_timed_for_the_thread_choice(target):
    """The kernels' thread choice compares the target's forwards: an early exit's (its first layers) and a
    self-draft's requantized stack (the same architecture, ``replaced`` layers) are drafts, not timed."""
    tokens, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]  # [1, 3] each
    with two_threads():
        calls = THREADS.schedule.events
        draft = target.first_layers(1)
        draft.forward(tokens, positions, draft.new_cache())
        assert THREADS.schedule.events == calls
        target.forward(tokens, positions, target.new_cache())
        assert THREADS.schedule.events == calls + 1
    assert target._native.measured and not target._native.replaced(target._native.layers).measured


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_draft_logits_do_not_depend_on_the_others(target, kind):
    """Rows drafted together (the nodes of a tree depth, the rows of a batch) give each row's features and
    logits bit for bit as that row alone."""
    native = native_copy(random_head(target, kind))
    features = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        if isinstance(native, EagleHead):  # one token each after the same 4 slots, together and alone
            together = eagle_after_context(native, features, range(5))
            alone = torch.cat([eagle_after_context(native, features, [i]) for i in range(5)])
        else:
            together = draft_features(native, features, target)
            alone = torch.cat([draft_features(native, features[i : i + 1], target) for i in range(5)])
        assert torch.equal(together, alone)
        assert torch.equal(native.logits(together), torch.cat([native.logits(row[None]) for row in alone]))


def test_an_eagle_heads_slots_may_run_behind_its_positions(target):
    """A catch-up that skipped pairs (a window) feeds its next slots at later positions: the native head
    rotates each slot by the position given, as the float32 head does (a gap between slots' positions changes
    what the later ones read), not by the slot."""
    plain = random_head(target, "eagle")
    attention = plain.layers[0].self_attn
    with torch.no_grad():  # sharp attention, so that where each slot sits matters
        for projection in (attention.q_proj, attention.k_proj):
            projection.weight.mul_(6.0)
    native = native_copy(plain)
    features = torch.randn(1, 7, target.config.hidden_size, generator=torch.Generator().manual_seed(3))
    tokens = torch.arange(7)[None] % VOCAB  # [1, 7]
    out = {}
    with torch.no_grad():
        for name, head in (("plain", plain), ("native", native)):
            for gap in (0, 40):
                cache = head.new_cache(1, 64)
                head(tokens[:, :3], features[:, :3], torch.arange(3)[None], cache)  # slots 0..2
                later = torch.arange(3 + gap, 7 + gap)[None]  # slots 3..6 at these positions
                out[name, gap] = head(tokens[:, 3:], features[:, 3:], later, cache)[0]
    a, b = out["plain", 40], out["native", 40]
    torch.testing.assert_close(b, a, atol=0.03 * float(a.abs().max()), rtol=0.03)
    # the gap is seen: read as slots (no gap), the native head's outputs would be ~6× farther from these
    assert float((b - a).abs().max()) < 0.5 * float((out["native", 0] - a).abs().max())


@pytest.mark.parametrize(
    "sampling",
    [
        GREEDY,
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=0.7, top_k=5, seed=6, invariant=False),
    ],
    ids=["greedy", "invariant", "generator"],
)
def test_rows_of_a_batch_draft_together_each_as_alone(target, sampling, monkeypatch):
    """Eagle drafters whose caches are rows of the head's cache for one batch (cache_row of the target's
    rows) propose together — the backlogs in one head forward, then one per draft position — and each row's
    proposal (tokens and q) is bit for bit what a drafter of its own proposes for it alone, whatever the
    rows' contexts, K (0 and a grammar's end among them) and order; a second round after a rollback too."""
    head = native_copy(fresh_head(target, torch.arange(0, VOCAB, 2), seed=2))
    assert isinstance(head, EagleHead)
    slots = target.new_cache_rows(4)
    calls = []
    monkeypatch.setattr(
        eagle_module,
        "native_rows",
        lambda caches, counts: (calls.append(len(caches)), rows_of(caches, counts))[1],
    )
    rng = torch.Generator().manual_seed(7)
    contexts = [torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (9, 5, 14, 7)]
    ks = [3, 4, 0, 2]

    def stop_early(path: list[int]) -> torch.Tensor | None:  # a grammar that ends after one token
        return None if len(path) >= 1 else torch.ones(VOCAB, dtype=torch.bool)

    alloweds: list[Allowed | None] = [None, None, None, stop_early]
    together = [EagleDrafter(head, sampling, head.cache_row(slots[i])) for i in (2, 0, 3, 1)]  # any rows
    assert len({d.rows_key for d in together}) == 1 and together[0].rows_key is not None
    for d, context in zip(together, contexts, strict=True):
        d.begin(context)
        d.observe_hidden(hidden_states(target, context)[:-1])
    alone = [drafter_with_context(target, head, context, sampling) for context in contexts]
    assert all(d.rows_key is None for d in alone)
    for _ in range(2):
        proposals = rows_as_alone(EagleDrafter, together, alone, contexts, ks, alloweds, sampling, calls)
        assert [len(p.tokens) for p in proposals] == [3, 4, 0, 1]
        for d, other in zip(together, alone, strict=True):  # one accepted, then a committed token's state
            d.observe(1)
            other.observe(1)
        extra = torch.randn(1, target.config.hidden_size, generator=rng)
        for d in (*together, *alone):
            d.observe_hidden(extra)
        contexts = [[*c, 1] for c in contexts]


def rows_as_alone(kind, together, alone, contexts, ks, alloweds, sampling, calls: list[int]) -> list:
    """One round of ``together``'s proposals in one ``kind.propose_rows`` call (its forwards' rows counted in
    ``calls``: several at once), each (tokens and q) bit for bit what its drafter in ``alone`` proposes for
    the same context, K and grammar; the proposals."""
    rows = [DraftRow(d, c, k, sampling.generator(), a)
            for d, c, k, a in zip(together, contexts, ks, alloweds, strict=True)]  # fmt: skip
    calls.clear()
    proposals = kind.propose_rows(rows)
    assert calls and max(calls) >= 3  # rows ran together
    for d, c, k, a, got in zip(alone, contexts, ks, alloweds, proposals, strict=True):
        own = d.propose(c, k, sampling.generator(), a)
        assert torch.equal(got.tokens, own.tokens), c
        assert (got.q is None) == (own.q is None) and (got.q is None or torch.equal(got.q, own.q))
    return proposals


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(temperature=0.8, seed=5)], ids=["greedy", "seeded"]
)
def test_medusa_rows_draft_together_each_as_alone(target, sampling, monkeypatch):
    """Medusa drafters of one set of native heads propose together (one call of the heads over the rows'
    states, as many heads as the largest K needs) and each row's proposal is its own, bit for bit; float32
    heads (oneDNN: a row's sums may follow the call's row count) never propose together."""
    heads = native_copy(random_medusa(target, torch.arange(0, VOCAB, 2)))
    calls: list[int] = []
    forward = type(heads).forward
    monkeypatch.setattr(
        type(heads), "forward", lambda self, f, n=None: (calls.append(len(f)), forward(self, f, n))[1]
    )
    rng = torch.Generator().manual_seed(8)
    contexts = [torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (9, 5, 14, 1)]  # one: no state
    ks = [3, 1, 0, 4]
    drafters = [MedusaDrafter(heads, sampling) for _ in contexts]
    alone = [MedusaDrafter(heads, sampling) for _ in contexts]
    for d, other, context in zip(drafters, alone, contexts, strict=True):
        for each in (d, other):
            each.begin(context)
            each.observe_hidden(hidden_states(target, context)[:-1])
    assert len({d.rows_key for d in drafters}) == 1 and drafters[0].rows_key is not None
    rows = [DraftRow(d, c, k, sampling.generator()) for d, c, k in zip(drafters, contexts, ks, strict=True)]
    proposals = MedusaDrafter.propose_rows(rows)
    assert calls == [2]  # the two rows with a state and a K, in one call
    for d, c, k, got in zip(alone, contexts, ks, proposals, strict=True):
        own = d.propose(c, k, sampling.generator())
        assert torch.equal(got.tokens, own.tokens) and (got.q is None) == (own.q is None)
        assert got.q is None or torch.equal(got.q, own.q)
    assert [len(p.tokens) for p in proposals] == [3, 1, 0, 0]
    assert MedusaDrafter(random_medusa(target, torch.arange(VOCAB)), sampling).rows_key is None


def test_eagle_draft_call_is_its_products_layers_and_norm_one_by_one(target):
    """The native head's one-call forward (``vs_draft``: embedding, fc, layers, norm, draft logits) gives bit
    for bit what fc, the layers' forward, the norm and the head rows give called one by one, and writes the
    same keys and values: a backlog of several tokens, then draft steps of one, rows of one cache together
    and a cache of its own alike."""
    head = native_copy(fresh_head(target, torch.arange(0, VOCAB, 2), seed=2))
    assert isinstance(head, EagleHead)
    gen = torch.Generator().manual_seed(4)
    h = target.config.hidden_size
    whole = head.new_cache(batch_size=3, capacity=32).rows()
    fused, calls = [head.new_cache(1, 32), whole[2]], [head.new_cache(1, 32), head.new_cache(1, 32)]
    tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)  # [rows, T]
    features = torch.randn(2, 6, h, generator=gen)  # [rows, T, H]
    positions = torch.arange(6)
    for i in range(2):
        got = head.forward_rows([(tokens[i], features[i], positions, fused[i])])[0]  # [T, H]
        fc_in = torch.cat((head.embed(tokens[i]), features[i]), -1)  # [T, 2H]
        expected = head._native_layers(head._stack, head.fc(fc_in)[None], positions[None], calls[i], None)[0]
        assert torch.equal(got, expected)
    for step in range(3):
        step_tokens = torch.randint(0, VOCAB, (2,), generator=gen).tolist()
        step_features = torch.randn(2, h, generator=gen)  # [rows, H]
        got, logits = head.step_rows(step_tokens, step_features, [6 + step] * 2, fused)
        for i in range(2):
            fc_in = torch.cat((head.embed(torch.tensor(step_tokens[i])), step_features[i]))[None]  # [1, 2H]
            position = torch.tensor([[6 + step]])
            expected = head._native_layers(head._stack, head.fc(fc_in)[None], position, calls[i], None)[0]
            assert torch.equal(got[i : i + 1], expected)
            assert torch.equal(logits[i : i + 1], head.logits(expected))
    for a, b in zip(fused, calls, strict=True):  # the 9 slots written (tiled keys: the first tile's)
        assert a.length == b.length == 9
        (ka, va), (kb, vb) = (a.whole or (a.keys, a.values)), (b.keys, b.values)
        assert isinstance(ka, torch.Tensor) and isinstance(va, torch.Tensor)
        assert isinstance(kb, torch.Tensor) and isinstance(vb, torch.Tensor)
        row = a.row or 0  # [layers, kv_heads, tiles, head_dim, 16] and [layers, kv_heads, slots, head_dim]
        assert torch.equal(ka[:, row, :, 0, :, :9], kb[:, 0, :, 0, :, :9])
        assert torch.equal(va[:, row, :, :9], vb[:, 0, :, :9])


def test_eagle_greedy_call_drafts_as_step_by_step(target):
    """The native head's greedy drafting in one call (``vs_draft_greedy``) drafts what its forwards one by
    one and the draft vocabulary's argmax draft, rows of one cache together, each its own number of steps;
    each row's cache then holds one slot per step."""
    head = native_copy(fresh_head(target, torch.arange(0, VOCAB, 2), seed=2))
    assert isinstance(head, EagleHead)
    gen = torch.Generator().manual_seed(5)
    h = target.config.hidden_size
    together, alone = (
        head.new_cache(batch_size=4, capacity=32).rows()[1:],
        [head.new_cache(1, 32) for _ in range(3)],
    )
    context = torch.randint(0, VOCAB, (3, 6), generator=gen)  # [rows, T]
    features = torch.randn(3, 6, h, generator=gen)  # [rows, T, H]
    for i in range(3):
        for cache in (together[i], alone[i]):
            head.forward_rows([(context[i], features[i], torch.arange(6), cache)])
    first, start = torch.randint(0, VOCAB, (3,), generator=gen).tolist(), torch.randn(3, h, generator=gen)
    steps = [4, 1, 2]
    drafts = head.greedy_rows(first, start, [6] * 3, together, steps)
    for i in range(3):
        token, feature, expected = first[i], start[i : i + 1], []
        for step in range(steps[i]):
            position = torch.tensor([[6 + step]])
            feature = head(torch.tensor([[token]]), feature[None], position, alone[i])[0]  # [1, H]
            token = int(head.draft_vocab[head.logits(feature)[0].argmax()])
            expected.append(token)
        assert drafts is not None and drafts[i] == expected
        assert together[i].length == alone[i].length == 6 + steps[i]


def eagle_after_context(head: EagleHead, features: torch.Tensor, rows) -> torch.Tensor:
    """The head's features [M, H] for rows ``rows`` of features [N, H], each fed as one token at position 4
    after the same 4 context slots (a tree depth's nodes: each sees the context and itself)."""
    cache, rows = head.new_cache(1, 16), list(rows)
    head(torch.arange(4)[None], features[None, :4], torch.arange(4)[None], cache)
    m = len(rows)
    mask = torch.cat([torch.ones(m, 4, dtype=torch.bool), torch.eye(m, dtype=torch.bool)], 1)  # [M, 4 + M]
    tokens, positions = torch.tensor([rows]), torch.full((1, m), 4)  # [1, M]
    return head(tokens, features[None, rows], positions, cache, mask)[0]


def test_eagle_tree_nodes_read_their_paths_features_bit_for_bit(target):
    """A native head's token tree: each inner node's children come from the very feature (bit for bit) that
    drafting its path as a chain predicts."""
    head = native_copy(fresh_head(target, torch.arange(VOCAB), seed=2))
    assert isinstance(head, EagleHead)
    read: list[torch.Tensor] = []
    logits = head.logits
    head.logits = lambda f: (read.extend(f.reshape(-1, f.shape[-1])), logits(f))[1]
    context = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    shape = TreeShape.full(2, 3)
    tree = EagleTreeDrafter(drafter_with_context(target, head, context, GREEDY), shape).propose_tree(
        context, shape, torch.Generator()
    )
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    inner = sorted({parents[v] for v in range(1, len(tokens))})
    assert len(read) == len(inner)
    for node, feature in zip(inner, read, strict=True):
        path = []
        while node > 0:
            path.insert(0, tokens[node])
            node = parents[node]
        chain = drafter_with_context(target, head, context, GREEDY)
        expected = chain.catch_up(context)  # [1, 1, H]
        assert expected is not None
        for i, token in enumerate(path):
            position = torch.tensor([[len(context) - 1 + i]])
            expected = head(torch.tensor([[token]]), expected, position, chain.cache)
        assert torch.equal(feature, expected[0, 0])


@pytest.fixture(scope="module")
def greedy(target) -> dict[str, list[int]]:
    return plain_greedy(target, LetterTokenizer(VOCAB), PROMPTS, 40)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_greedy_on_the_native_target(target, greedy, kind, tmp_path):
    """Each kind loaded beside the native target drafts on the native kernels (chains, and an eagle tree):
    token for token the target's greedy output; both accepted and rejected drafts occur."""
    path = random_head(target, kind).save(tmp_path / f"{kind}.safetensors")
    drafted = accepted = 0
    for tree in (None, TreeShape.full(2, 2)) if kind == "eagle" else (None,):
        spec = Speculator((target, LetterTokenizer(VOCAB)), drafter=kind, drafter_path=str(path), tree=tree)
        assert spec.head is not None and spec.head.cpu_precision == "q8_0"
        for prompt, reference in greedy.items():
            stats = GenerationStats(kind, "3")
            out = spec.stream(prompt, k=3, max_new_tokens=40, sampling=GREEDY, stats=stats)
            assert [t for chunk in out for t in chunk.token_ids] == reference, (prompt, tree)
            drafted, accepted = drafted + stats.drafted + stats.tree_nodes, accepted + stats.accepted
    assert 0 < accepted < drafted


@pytest.mark.parametrize("broken", [False, True], ids=["together", "call-raises"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8)], ids=["greedy", "seeded"])
def test_a_continuous_batch_drafts_its_rows_together(target, greedy, sampling, broken, tmp_path, monkeypatch):
    """Through the engine: a continuous batch of eagle requests proposes its rows together (one call for
    several rows), and each output is the one the request gets alone (greedy: the target's own; sampled
    with a seed: the same tokens); when a call for several rows raises (here after drafting them all), each
    row's drafter is rolled back and asked alone: the outputs are the same."""
    path = random_head(target, "eagle").save(tmp_path / "eagle.safetensors")
    spec = Speculator((target, LetterTokenizer(VOCAB)), drafter="eagle", drafter_path=str(path))

    def fault(rows, proposals):
        if broken and len(rows) > 1:
            raise RuntimeError("a fault after drafting")

    batch = batch_and_alone(spec, EagleDrafter, sampling, monkeypatch, after=fault)
    if sampling.greedy:
        assert all(result.token_ids == greedy[prompt] for prompt, result in zip(PROMPTS, batch, strict=True))


def batch_and_alone(spec: Speculator, drafter: type, sampling, monkeypatch, prompts=PROMPTS, after=None):
    """``prompts`` generated in a continuous batch of 4 slots with seeds 0.., ``drafter.propose_rows`` watched
    (then ``after(rows, proposals)`` called): some call proposed for several rows, and each result is the one
    its request gets alone with its seed. Returns the batch's results."""
    sizes: list[int] = []
    original = drafter.propose_rows.__func__  # type: ignore[attr-defined]

    def watched(cls, rows):
        sizes.append(len(rows))
        proposals = original(cls, rows)
        if after is not None:
            after(rows, proposals)
        return proposals

    monkeypatch.setattr(drafter, "propose_rows", classmethod(watched))
    seeds = list(range(len(prompts)))
    batch = spec.generate_batch(
        list(prompts), k=3, max_new_tokens=40, sampling=sampling, slots=4, seeds=seeds
    )
    assert max(sizes) >= 2
    for prompt, seed, result in zip(prompts, seeds, batch, strict=True):
        alone = spec.generate(prompt, k=3, max_new_tokens=40, sampling=sampling.with_seed(seed))
        assert result.token_ids == alone.token_ids, prompt
    return batch


@pytest.mark.parametrize("sampling_kw", [{"temperature": 0.8}, {"temperature": 0.7, "top_k": 5}])
def test_sampled_q_is_the_native_heads_own_distribution(target, sampling_kw):
    """At a temperature, the eagle drafter's q of its first token is what the sampling transform gives for
    the native head's own logits (−inf outside the draft vocabulary), and holds the sampled tokens."""
    head = native_copy(fresh_head(target, torch.arange(0, VOCAB, 2), seed=2))
    assert isinstance(head, EagleHead)
    context, sampling = [3, 14, 15, 9, 2, 6], SamplingParams(**sampling_kw)
    drafter = drafter_with_context(target, head, context, sampling)
    proposal = drafter.propose(context, 3, torch.Generator().manual_seed(0))
    assert proposal.q is not None and (proposal.q[torch.arange(3), proposal.tokens] > 0).all()
    feature = drafter_with_context(target, head, context, sampling).catch_up(context)  # [1, 1, H]
    assert feature is not None
    full = torch.full((VOCAB,), float("-inf"))  # [V]
    full[head.draft_vocab] = head.logits(feature[0])[0]
    assert torch.equal(proposal.q[0], probs_from_logits(full, sampling))


@pytest.mark.slow
@pytest.mark.parametrize("tree", [None, TreeShape.full(2, 2)], ids=["chain", "2x2"])
def test_first_sampled_token_follows_the_native_target(target, tree, tmp_path):
    """A chi-square of the first token sampled through the engine with a native eagle head (a chain, and a
    tree of sampled children) against the native target's own next-token distribution."""
    path = random_head(target, "eagle").save(tmp_path / "eagle.safetensors")
    spec = Speculator((target, LetterTokenizer(VOCAB)), drafter="eagle", drafter_path=str(path), tree=tree)
    assert spec.head is not None and spec.head.cpu_precision == "q8_0"
    prompt = "hello"
    sampling_kw = {"temperature": 0.8}
    assert first_token_chi_square(spec, target, spec.encode_prompt(prompt), prompt, sampling_kw) > ALPHA
