"""Walking a draft tree in tests: every valid node with the tokens on its path from the root."""

from __future__ import annotations

from collections.abc import Iterator


def node_paths(tree, first: int = 1) -> Iterator[tuple[int, list[int]]]:
    """``(node index, the tokens below the root down to it)`` for every valid node of ``tree`` (a
    ``spec_decode.tree.DraftTree``) from node ``first`` on (0 is the root, whose path is empty)."""
    toks, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    for i in range(first, len(toks)):
        if not valid[i]:
            continue
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = parents[j]
        yield i, path[::-1]
