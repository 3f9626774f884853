"""Token trees: shapes compiled from paths (and refused when malformed), trees merged from continuations, and
the one-forward tree attention of the native model and the transformers adapter, with KV compaction."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_hf_adapter import tiny_model
from toy import single_threaded
from verispec.drafting.tree import TreeShape, likeliest_nodes
from verispec.models import Llama, LlamaConfig, TreeCache
from verispec.models.hf import HFModel

ATOL = 1e-4
# "top-1, top-2; after top-1 its two best; after those the best": 6 nodes, depth 3
PATHS = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


# ---------------------------------------------------------------------------------------------- shapes


def test_shape_from_paths_is_breadth_first_with_ancestor_mask():
    shape = TreeShape.from_paths(reversed(PATHS))  # any order in, BFS order out
    assert shape.paths == ((), (0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert shape.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert shape.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert shape.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert (shape.num_nodes, shape.max_depth) == (6, 3)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    ancestors = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 1, 3, 5]]  # each node's, itself included
    for node, seen in enumerate(ancestors):
        expected[node, seen] = True
    assert torch.equal(shape.mask, expected)
    assert shape.children() == [[1, 2], [3, 4], [], [5], [], []]


def test_full_chain_parents_and_file_shapes_agree():
    full = TreeShape.full(2, 3)
    assert full.num_nodes == 15 and full.max_depth == 3 and full.name == "2x3"
    assert full.paths[:4] == ((), (0,), (1,), (0, 0))
    chain = TreeShape.chain(4)
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3] and chain.mask.tril().equal(chain.mask)
    assert torch.equal(chain.mask, torch.ones(5, 5, dtype=torch.bool).tril())
    same = TreeShape.from_parents([-1, 0, 0, 1, 1, 3])
    assert same.paths == TreeShape.from_paths(PATHS).paths
    # a parents list in any order: ranks follow the index order among siblings
    assert TreeShape.from_parents([-1, 2, 0, 0]).paths == ((), (0,), (1,), (0, 0))


def test_shape_file_and_spec(tmp_path):
    path = tmp_path / "shape.json"
    path.write_text(json.dumps([list(p) for p in PATHS]))
    shape = TreeShape.load(path)
    assert shape.paths == TreeShape.from_paths(PATHS).paths and shape.name == "shape"
    assert TreeShape.parse(str(path)).paths == shape.paths
    assert TreeShape.parse("3x2").num_nodes == 13
    read, write = os.pipe()  # a shape given by process substitution, <(...): /dev/fd/N names no tree
    os.write(write, json.dumps([list(p) for p in PATHS]).encode())
    os.close(write)
    try:
        assert TreeShape.load(f"/dev/fd/{read}").name == f"{len(PATHS)}-node"
    finally:
        os.close(read)


@pytest.mark.parametrize(
    "paths,message",
    [
        ([(0,), (0, 0), (0, 0, 0, 0)], "gap in depth"),
        ([(0,), (2,)], "gap in rank"),
        ([(0,), (0,)], "appears twice"),
        ([(0,), (-1,)], "negative rank"),
        ([(0,), ("a",)], "integer child ranks"),
        ([], "at least one draft node"),
        ([1, 2], "list of paths"),
    ],
)
def test_malformed_paths_are_refused_in_one_line(paths, message):
    with pytest.raises(ValueError, match=message) as err:
        TreeShape.from_paths(paths)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "parents,message",
    [
        ([-1, 2, 1], "cycle"),
        ([-1, 0, 3, 2], "cycle"),
        ([-1, 1], "cycle"),
        ([-1, 5], "not a node index"),
        ([0, 0], "starts with -1"),
    ],
)
def test_malformed_parents_are_refused(parents, message):
    with pytest.raises(ValueError, match=message):
        TreeShape.from_parents(parents)


def test_too_many_nodes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="more than the limit"):
        TreeShape.full(8, 4)  # 4681 nodes
    with pytest.raises(ValueError, match="a 1000x1000 tree has more than the limit of 1024 nodes"):
        TreeShape.full(1000, 1000)  # a count of 3,000 digits, never formatted as a float
    with pytest.raises(ValueError, match="exceeds the limit of 4"):
        TreeShape.from_paths(PATHS, max_nodes=4)
    with pytest.raises(ValueError, match="context of 15 positions"):
        TreeShape.full(2, 3).check_fits(15)
    TreeShape.full(2, 3).check_fits(16)
    for text, message in (("{", "not valid JSON"), ('{"a": 1}', "list of paths"), ("[[1]]", "gap in rank")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            TreeShape.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read"):
        TreeShape.load(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="width must be"):
        TreeShape.full(0, 2)


def test_capped_shapes_are_breadth_first_prefixes():
    shape = TreeShape.full(2, 3)
    assert shape.capped(3, 100) is shape
    assert shape.capped(1, 100).paths == ((), (0,), (1,))
    assert shape.capped(3, 5).paths == shape.paths[:5]
    assert shape.capped(0, 100).num_nodes == 1


def test_dynamic_shapes_parse_and_keep_their_budget(tmp_path):
    """SPEC:N and SPEC:auto name dynamic trees: the same nodes, a budget that capping keeps, at most N + 1
    positions per forward; with_budget(None) makes a shape static again; bad budgets are refused."""
    path = tmp_path / "e3.json"
    path.write_text(json.dumps([[0], [1], [0, 0]]))
    dynamic = TreeShape.parse("3x4:6")
    assert (dynamic.name, dynamic.budget, dynamic.max_forward) == ("3x4:6", 6, 7)
    assert dynamic.paths == TreeShape.full(3, 4).paths and TreeShape.full(3, 4).max_forward == 121
    assert dynamic.capped(2, 100).budget == 6 and dynamic.capped(2, 100).name == "3x4:6"
    auto = TreeShape.parse(f"{path}:auto")
    assert (auto.name, auto.budget, auto.max_forward) == ("e3:auto", "auto", 4)
    assert TreeShape.parse("2x2:50").max_forward == 7  # never more than the shape
    static = dynamic.with_budget(None)
    assert static.budget is None and static.name == "3x4" and static.with_budget(2).name == "3x4:2"
    for bad in (0, -1, True, "many", 2.5):
        with pytest.raises(ValueError, match="node budget"):
            TreeShape.full(2, 2).with_budget(bad)
    with pytest.raises(ValueError, match="not valid JSON|cannot read"):
        TreeShape.parse("3x4:six")  # not a budget: read as a file name


@given(st.data())
def test_likeliest_nodes_hold_every_ancestor(data):
    """On random trees whose scores are path probabilities (a node's score: its parent's × a probability,
    ties included), likeliest_nodes returns the root and the ``count`` best-scoring draft nodes, ancestors
    always included."""
    n = data.draw(st.integers(2, 30))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    probs = [data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0, 1)) for _ in range(n)]
    scores = [1.0]
    for i in range(1, n):
        scores.append(scores[parents[i]] * probs[i])
    count = data.draw(st.integers(0, n + 2))
    chosen = likeliest_nodes(scores, count)
    assert chosen[0] == 0 and chosen == sorted(set(chosen)) and len(chosen) == 1 + min(count, n - 1)
    assert all(parents[i] in chosen for i in chosen[1:])
    left = [scores[i] for i in range(1, n) if i not in chosen]
    if left and len(chosen) > 1:
        assert min(scores[i] for i in chosen[1:]) >= max(left)


def test_merge_builds_the_prefix_tree_within_the_shape():
    shape = TreeShape.from_paths(PATHS)
    continuations = [[5, 6, 7, 8], [5, 6, 9], [5, 4], [3, 2], [1], [5, 4, 4]]
    tree = shape.merge(9, continuations)
    # root 9; children 5 (rank 0) and 3 (rank 1); under 5: 6 and 4; under 6: 7. [1] finds no rank-2 slot.
    assert tree.tokens.tolist() == [9, 5, 3, 6, 4, 7]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert torch.equal(tree.mask, shape.mask) and tree.q is None
    small = shape.merge(9, [[5, 6]])
    assert small.tokens.tolist() == [9, 5, 6] and small.parents.tolist() == [-1, 0, 1]
    assert torch.equal(small.mask, shape.mask[[0, 1, 3]][:, [0, 1, 3]])
    assert shape.merge(9, []).tokens.tolist() == [9]


# ---------------------------------------------------------------------------------------------- models


def tiny_llama(seed: int = 0) -> Llama:
    """A random native Llama (GQA, untied head) with weights of a realistic scale."""
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
    )
    model = Llama(config)
    g = torch.Generator().manual_seed(seed)

    def weight(name: str, shape: torch.Size) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return 1 + 0.2 * torch.randn(shape, generator=g)
        return torch.randn(shape, generator=g) * (1.0 if "embed" in name else shape[-1] ** -0.5)

    model.load_weights((name, weight(name, p.shape)) for name, p in model.named_parameters())
    return model


def chain_logits(model, ids: list[int]) -> torch.Tensor:
    """The last logits [V] of a plain forward over ``ids`` into an empty cache."""
    cache = model.new_cache(1, 32)
    return model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0, -1]


def tree_forward(model, prefix: list[int], tokens: list[int], shape: TreeShape):
    """Prefill prefix[:-1], then score the tree (root = prefix[-1]) in one forward: (logits [N, V], cache)."""
    cache = model.new_cache(1, 32)
    start = len(prefix) - 1
    model.forward(torch.tensor([prefix[:-1]]), torch.arange(start)[None], cache)
    tree = torch.tensor([[prefix[-1], *tokens]])  # [1, N]
    logits = model.forward(tree, (start + shape.depth)[None], cache, tree_mask=shape.mask)  # [1, N, V]
    assert cache.length == start + shape.num_nodes
    return logits[0], cache


MODELS = {
    "native": tiny_llama,
    "hf-llama": lambda: HFModel(tiny_model("llama").eval()),
    "hf-gpt2": lambda: HFModel(tiny_model("gpt2").eval()),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_tree_forward_equals_each_path_as_a_chain(kind):
    """Node i's logits from one tree forward equal the last logits of a plain forward over the committed
    tokens and the root-to-node path."""
    model = MODELS[kind]()
    shape = TreeShape.from_paths(PATHS)
    prefix, tokens = [3, 14, 15, 9, 26], [5, 35, 8, 9, 7]
    logits, _ = tree_forward(model, prefix, tokens, shape)
    all_tokens = [prefix[-1], *tokens]
    for node in range(shape.num_nodes):
        path = [all_tokens[j] for j in range(node + 1) if shape.mask[node, j]]
        torch.testing.assert_close(logits[node], chain_logits(model, prefix[:-1] + path), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("accepted", [[1, 3, 5], [2], [1, 4], []])
def test_compaction_equals_recomputing_the_accepted_path(kind, accepted):
    """After compacting the accepted path into place, the cache holds the committed tokens and the path, and
    the next forward gives the logits of a plain forward over them."""
    model = MODELS[kind]()
    shape = TreeShape.from_paths(PATHS)
    prefix, tokens = [3, 14, 15, 9, 26], [5, 35, 8, 9, 7]
    _, cache = tree_forward(model, prefix, tokens, shape)
    assert isinstance(cache, TreeCache)
    start = len(prefix) - 1
    cache.compact(len(prefix), [start + n for n in accepted])
    assert cache.length == len(prefix) + len(accepted)
    committed = prefix + [tokens[n - 1] for n in accepted]
    positions = torch.arange(2)[None] + len(committed)  # [1, 2]
    after = model.forward(torch.tensor([[11, 12]]), positions, cache)[0]  # [2, V]
    assert cache.length == len(committed) + 2
    torch.testing.assert_close(after[-1], chain_logits(model, committed + [11, 12]), atol=ATOL, rtol=0)
    torch.testing.assert_close(after[0], chain_logits(model, committed + [11]), atol=ATOL, rtol=0)


def test_native_compaction_moves_exactly_the_kept_entries_and_checks_its_slots():
    model = tiny_llama()
    cache = model.new_cache(1, 16)
    model.forward(torch.arange(8)[None], torch.arange(8)[None], cache)
    keys = cache.keys.clone()
    cache.compact(3, [4, 6])
    assert cache.length == 5
    assert torch.equal(cache.keys[:, :, :, :3], keys[:, :, :, :3])
    assert torch.equal(cache.keys[:, :, :, 3:5], keys[:, :, :, [4, 6]])
    for start, keep in ((3, [2]), (3, [4, 4]), (3, [5, 4]), (9, []), (3, [5])):
        with pytest.raises(ValueError, match="compact|ascend"):
            cache.compact(start, keep)


def test_tree_masks_are_checked():
    model = tiny_llama()
    cache = model.new_cache(1, 16)
    tokens, positions = torch.tensor([[1, 2]]), torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="tree_mask must be"):
        model.forward(tokens, positions, cache, tree_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="attend to itself"):
        model.forward(tokens, positions, cache, tree_mask=torch.zeros(2, 2, dtype=torch.bool))


def test_adapter_refuses_a_tree_where_the_mask_would_not_apply(monkeypatch):
    model = HFModel(tiny_model("llama").eval())
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(ValueError, match="custom 4-D"):
        model.forward(
            torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), model.new_cache(), tree_mask=torch.eye(2).bool()
        )
