"""DDTree selection, masks, the walk, and losslessness at T=1 (a chi-square test that can fail)."""

import math

import pytest
import torch

from engine.params import SamplingParams
from engine.sampling.sampler import sample
from model.tree_mask import ancestor_mask
from spec_decode.config import SpecConfig, SpecConfigError
from spec_decode.tree import DraftTree, build_chain, build_tree, build_tree_host, path_by_depth, tree_paths, walk
from tests.support.sampling import sampling_batch


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 16, 31, 64, 100, 128, 256, 512])
def test_vectorised_builder_builds_the_heaps_tree(budget):
    """Same node set and the same flattening (tokens, parents, depths, mask) from both builders."""
    gen = torch.Generator().manual_seed(budget)
    for vocab, depth in ((600, 7), (7, 4)):
        logq = (torch.randn(depth, vocab, generator=gen) * 3).log_softmax(dim=-1)
        tree, heap = build_tree(logq, root_token=11, budget=budget), build_tree_host(logq, 11, budget)
        assert tree_paths(tree) == tree_paths(heap)
        for field in ("tokens", "parents", "depth", "valid", "ancestors"):
            assert torch.equal(getattr(tree, field), getattr(heap, field)), field
        assert torch.equal(heap.ancestors, ancestor_mask(heap.parents))
        assert tree.tree_size == budget + 1 and int(tree.tokens[0]) == 11
        assert bool((tree.parents[1:] < torch.arange(1, tree.tree_size)).all()), "parents must precede children"
        assert bool((tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all())


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_rows_below_the_budget_depth_never_matter(budget):
    """A budget-B tree is at most B deep, so the speculator drafts only ``SpecConfig.draft_rows`` rows."""
    logits = torch.randn(15, 5, generator=torch.Generator().manual_seed(budget))
    logits[:, 0] += 12.0  # one near-certain token per depth: the best tree is the chain as deep as B allows
    logq = logits.log_softmax(dim=-1)
    rows = SpecConfig("ddtree", budget=budget, drafter_path="unused").draft_rows
    full = build_tree(logq, 0, budget)
    assert rows == budget and int(full.depth.max()) == budget
    assert tree_paths(build_tree(logq[:rows], 0, budget)) == tree_paths(full)
    assert SpecConfig("dflash", budget=budget, drafter_path="unused").draft_rows == 15


def test_budget_larger_than_all_prefixes_marks_padding_invalid():
    logq = torch.tensor([[0.7, 0.3], [0.6, 0.4]]).log()
    tree, heap = build_tree(logq, 0, budget=8), build_tree_host(logq, 0, budget=8)  # only 2 + 4 prefixes exist
    assert int(tree.valid.sum()) == int(heap.valid.sum()) == 1 + 6
    assert tree_paths(tree) == tree_paths(heap) and len(tree_paths(heap)) == 6
    assert torch.equal(tree.tokens[:7], heap.tokens[:7]) and torch.equal(tree.parents[:7], heap.parents[:7])


def test_minus_inf_prefixes_are_never_valid():
    logq = torch.tensor([[0.0, float("-inf"), float("-inf")], [-0.1, -2.4, float("-inf")]])
    tree, heap = build_tree(logq, 0, budget=4), build_tree_host(logq, 0, budget=4)
    assert tree_paths(tree) == tree_paths(heap) == {(0,), (0, 0), (0, 1)}


def test_ancestor_mask_and_walk_hand_worked():
    # root 0; children 1 (tok 5), 2 (tok 6); 3 (tok 7) under 1; 4 (tok 8) under 3; 5 (tok 9) under 2
    tree = DraftTree(tokens=torch.tensor([4, 5, 6, 7, 8, 9]), parents=torch.tensor([-1, 0, 0, 1, 3, 2]),
                     depth=torch.tensor([0, 1, 1, 2, 3, 2]), valid=torch.ones(6, dtype=torch.bool))
    mask = ancestor_mask(tree.parents, 3)
    assert mask[4].tolist() == [True, True, False, True, True, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]
    picks = torch.tensor([5, 7, 9, 1, 0, 0])  # root→5 ✓, node1→7 ✓, node3→1 ✗ (node 4 has 8)
    assert walk(tree, picks).nonzero().flatten().tolist() == [0, 1, 3]
    picks = torch.tensor([6, 7, 9, 8, 0, 0])  # root→6 picks the other branch, then node2→9
    assert walk(tree, picks).nonzero().flatten().tolist() == [0, 2, 5]


@pytest.mark.parametrize("seed", range(20))
def test_walk_follows_matching_children_to_a_dead_end(seed):
    """On random trees and picks: the accepted set is one root path, each accepted node's token is the pick
    at its parent, and no child of the path's last node matches (the walk stops only where it must)."""
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.randn(5, 3, generator=g).log_softmax(-1), 0, budget=12)
    assert torch.equal(tree.ancestors, ancestor_mask(tree.parents, 5))
    picks = torch.randint(0, 3, (tree.tree_size,), generator=g)
    path = walk(tree, picks).nonzero().flatten().tolist()
    assert path[0] == 0 and all(int(tree.parents[b]) == a for a, b in zip(path, path[1:], strict=False))
    assert all(int(tree.tokens[b]) == int(picks[a]) for a, b in zip(path, path[1:], strict=False))
    last = path[-1]
    children = [c for c in range(tree.tree_size) if int(tree.parents[c]) == last and bool(tree.valid[c])]
    assert all(int(tree.tokens[c]) != int(picks[last]) for c in children)


def test_path_by_depth_hand_worked():
    """The walk's path as one node per depth; past its end each entry is its own depth (a no-op gather)."""
    tree = DraftTree(tokens=torch.tensor([4, 5, 6, 7, 8, 9]), parents=torch.tensor([-1, 0, 0, 1, 3, 2]),
                     depth=torch.tensor([0, 1, 1, 2, 3, 2]), valid=torch.ones(6, dtype=torch.bool))
    both = DraftTree.stack([tree, tree])
    picks = torch.tensor([[5, 7, 9, 1, 0, 0], [6, 7, 9, 8, 0, 0]])
    path, count = path_by_depth(both, walk(both, picks), 4)
    assert path.tolist() == [[0, 1, 3, 3], [0, 2, 5, 3]] and count.tolist() == [3, 3]
    assert picks[0][path[0][:3]].tolist() == [5, 7, 1]  # committed: drafts 5, 7 and the bonus 1


@pytest.mark.parametrize("seed", range(5))
def test_batched_walk_equals_one_tree_at_a_time(seed):
    g = torch.Generator().manual_seed(seed)
    trees = [build_tree(torch.randn(5, 3, generator=g).log_softmax(-1), i, budget=12) for i in range(4)]
    picks = torch.randint(0, 3, (4, 13), generator=g)
    batched = walk(DraftTree.stack(trees), picks)
    path, count = path_by_depth(DraftTree.stack(trees), batched, 6)
    for i, tree in enumerate(trees):
        alone = walk(tree, picks[i])
        assert torch.equal(batched[i], alone)
        assert path[i][:count[i]].tolist() == alone.nonzero().flatten().tolist()
        assert path[i][count[i]:].tolist() == list(range(int(count[i]), 6))


def test_chain_is_the_argmax_path():
    logq = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]).log()
    chain = build_chain(logq, 3)
    assert chain.tokens.tolist() == [3, 1, 0, 1] and chain.parents.tolist() == [-1, 0, 1, 2]


# ---- losslessness at T=1 --------------------------------------------------------------------------
V, DEPTH, BUDGET, SAMPLES = 4, 3, 6, 4000


def target_logits(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed synthetic target: next-token logits as a deterministic function of the prefix."""
    gen = torch.Generator().manual_seed(hash(path) % (2 ** 31))
    return torch.randn(V, generator=gen) * 1.5


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(tree.tree_size):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = par[j]
        out.append(tuple(reversed(path)))
    return out


def first_two_tokens(accept_rule) -> torch.Tensor:
    """Commits (x1, x2) for SAMPLES seeds: speculative rounds over a DDTree with the given acceptance rule."""
    logq = (torch.randn(DEPTH, V, generator=torch.Generator().manual_seed(7)) * 2).log_softmax(-1)
    counts = torch.zeros(V, V)
    for seed in range(SAMPLES):
        committed: list[int] = []
        while len(committed) < 2:
            tree = build_tree(logq, root_token=0, budget=BUDGET)
            paths = [tuple(committed) + p for p in node_paths(tree)]
            logits = torch.stack([target_logits(p) for p in paths])
            committed += accept_rule(tree, logits, seed, len(committed))
        counts[committed[0], committed[1]] += 1
    return counts


def sample_and_walk(tree, logits, seed, generated):
    """The engine's rule: the pick at each node is the target's sample for that output index."""
    num_generated = [generated + int(d) for d in tree.depth]
    params = SamplingParams(temperature=1.0)
    sb = sampling_batch([params] * tree.tree_size, [seed] * tree.tree_size, num_generated)
    picks = sample(logits, sb).tokens
    path, count = path_by_depth(tree, walk(tree, picks), int(tree.depth.max()) + 1)
    return picks[path[:count]].tolist()  # what Speculator.accept commits


def greedy_biased_accept(tree, logits, seed, generated):
    """A deliberately biased rule: accept a drafted child whenever the target gives it probability >= 0.3."""
    probs = logits.softmax(-1)
    path, node = [], 0
    while True:
        children = [c for c in range(tree.tree_size) if int(tree.parents[c]) == node]
        good = [c for c in children if probs[node, tree.tokens[c]] >= 0.3]
        if not good:
            break
        node = good[0]
        path.append(int(tree.tokens[node]))
    root_only = DraftTree(tree.tokens[:1], tree.parents[:1], tree.depth[:1], tree.valid[:1], tree.ancestors[:1, :1])
    return path + sample_and_walk(root_only, logits[node:node + 1], seed + 10 ** 6, generated + len(path))


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def exact_first_two() -> torch.Tensor:
    p1 = target_logits(()).softmax(-1)
    return torch.stack([p1[a] * target_logits((a,)).softmax(-1) for a in range(V)]) * SAMPLES


def test_ddtree_sample_and_walk_matches_target_distribution():
    p = chi_square_p_value(first_two_tokens(sample_and_walk), exact_first_two())
    assert p > 1e-3, f"DDTree T=1 output distribution differs from the target's (chi-square p={p:.2e})"


def test_biased_acceptance_rule_is_detected():
    p = chi_square_p_value(first_two_tokens(greedy_biased_accept), exact_first_two())
    assert p < 1e-3, f"the chi-square test failed to detect a biased acceptance rule (p={p:.3f})"
    assert not math.isnan(p)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(method="medusa"), "spec_decode.method"), (dict(block_size=1), "spec_decode.block_size"),
    (dict(budget=0), "spec_decode.budget"), (dict(tree_temperature=0.0), "spec_decode.tree_temperature"),
    (dict(method="ddtree"), "spec_decode.drafter_path"),
    (dict(draft_head_dtype="fp8"), "spec_decode.draft_head_dtype")])
def test_bad_spec_config_names_the_field(kwargs, match):
    with pytest.raises(SpecConfigError, match=match):
        SpecConfig(**kwargs)
