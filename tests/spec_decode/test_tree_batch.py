"""The static draft builds every request's tree in one call: batched :func:`build_tree` and :func:`build_chain`
equal the one-tree builds, field by field, and the heap's node sets."""

import pytest
import torch

from spec_decode.tree import DraftTree, build_chain, build_tree, build_tree_host, tree_paths

FIELDS = ("tokens", "parents", "depth", "valid", "ancestors")


@pytest.mark.parametrize("budget", [1, 3, 8, 16, 64, 256])
def test_batched_tree_build_equals_one_tree_at_a_time(budget):
    gen = torch.Generator().manual_seed(budget)
    for vocab, depth in ((600, 7), (7, 4)):
        logq = (torch.randn(5, depth, vocab, generator=gen) * 3).log_softmax(dim=-1)  # [J, D, V]
        roots = torch.randint(0, vocab, (5,), generator=gen)
        batched = build_tree(logq, roots, budget)
        alone = DraftTree.stack([build_tree(logq[j], int(roots[j]), budget) for j in range(5)])
        for f in FIELDS:
            assert torch.equal(getattr(batched, f), getattr(alone, f)), f
        for j in range(5):
            heap = build_tree_host(logq[j], int(roots[j]), budget)
            assert tree_paths(DraftTree(*(getattr(batched, f)[j] for f in FIELDS))) == tree_paths(heap)
    two_dims = build_tree(logq.view(1, 5, depth, vocab), roots.view(1, 5), budget)
    assert two_dims.tokens.shape == (1, 5, budget + 1) and two_dims.ancestors.shape == (1, 5, budget + 1, budget + 1)
    assert torch.equal(two_dims.tokens[0], batched.tokens)


def test_batched_chain_equals_one_chain_at_a_time():
    logq = torch.randn(3, 6, 11, generator=torch.Generator().manual_seed(0)).log_softmax(dim=-1)
    roots = torch.tensor([4, 0, 9])
    batched = build_chain(logq, roots)
    alone = DraftTree.stack([build_chain(logq[j], int(roots[j])) for j in range(3)])
    for f in FIELDS:
        assert torch.equal(getattr(batched, f), getattr(alone, f)), f
    assert batched.parents.is_contiguous() and batched.ancestors.is_contiguous()  # static outputs are written into
