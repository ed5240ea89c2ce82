"""DDTree: the B most probable draft prefixes under a factorised distribution, as a flattened tree.

Score of a prefix ``(t_1..t_d)`` = ``Σ_i log q_i(t_i)`` where ``q_i`` is the drafter's distribution at
depth i. Only the top ``K = min(B, V)`` tokens per depth can appear. Two builders select the same node
set and flatten it the same way (up to exact score ties): :func:`build_tree_host` (best-first heap on the
host: the reference, and the builder on CPU) and :func:`build_tree` (fixed-shape tensor ops, no host
synchronisation, for accelerators and captured graphs: a per-depth beam of width B then a global top-B
over all depths — exact because a child never scores above its parent).

A :class:`DraftTree` is flattened with the root (the bonus token) at index 0, parents before
children, ordered by depth then score; position of node i = start + depth[i].
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from model.tree_mask import ancestor_mask

FIELDS = ("tokens", "parents", "depth", "valid", "ancestors")
SHORTLIST = 4  # build_tree_grammar: candidates per depth looked up by mask bits before a full-vocabulary search


@dataclass(frozen=True)
class DraftTree:
    """``tokens, parents, depth [N+1]`` int64 (root at 0, ``parents[0] = -1``); ``valid [N+1]`` bool
    (False for padding when fewer than B nodes exist); ``ancestors [N+1, N+1]`` bool, row i True at i and
    its ancestors (the builders pass it; otherwise it is derived from ``parents``). A batch of trees of one
    size has a leading ``[J]`` on every field (:meth:`stack`, the static draft step)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    ancestors: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ancestors is None:
            object.__setattr__(self, "ancestors", ancestor_mask(self.parents, int(self.depth.max())))

    @property
    def tree_size(self) -> int:
        """Nodes per tree, root included (N)."""
        return self.tokens.shape[-1]

    @staticmethod
    def stack(trees: list[DraftTree]) -> DraftTree:
        """J trees of one size → one batched tree (fields ``[J, ...]``)."""
        return DraftTree(*(torch.stack([getattr(t, f) for t in trees]) for f in FIELDS))

    def head(self, j: int) -> DraftTree:
        """The first ``j`` trees of a batch."""
        return DraftTree(*(getattr(self, f)[:j] for f in FIELDS))


def build_tree(logq: torch.Tensor, root_token: int | torch.Tensor, budget: int) -> DraftTree:
    """``logq [..., D, V]`` per-depth draft log-probs → the ``budget`` best prefixes (plus the root) of each of
    the ``[...]`` trees at once, rooted at ``root_token`` (an int, or ``[...]`` on the device); fields ``[..., N]``.

    Fixed shapes throughout: D beam steps of ``[J, B, K]`` candidates, then one top-B over ``[J, D*B]``.
    """
    *lead, d_max, vocab = logq.shape
    lq = logq.reshape(-1, d_max, vocab)  # [J, D, V]
    j, k, dev = lq.shape[0], min(budget, vocab), logq.device
    top_lp, top_tok = lq.topk(k, dim=-1)  # [J, D, K] sorted descending
    beam_score = torch.full((j, budget), float("-inf"), dtype=logq.dtype, device=dev)
    beam_score[:, :1].fill_(0.0)  # the root: a fill kernel (`beam_score[0] = 0.0` would copy a host scalar)
    scores, parents, tokens = [], [], []
    for d in range(d_max):
        cand = (beam_score[:, :, None] + top_lp[:, d, None, :]).reshape(j, -1)  # [J, B*K]
        best, idx = cand.topk(min(budget, cand.shape[1]), dim=-1)
        pad = budget - best.shape[1]  # fewer candidates than B at the first depths of a small vocab
        best = torch.nn.functional.pad(best, (0, pad), value=float("-inf"))
        idx = torch.nn.functional.pad(idx, (0, pad))
        scores.append(best)
        parents.append(idx // k)  # beam slot at depth d-1 (root slot 0 at depth 0)
        tokens.append(top_tok[:, d].gather(1, idx % k))
        beam_score = best
    flat_scores = torch.stack(scores, dim=1).reshape(j, -1)  # [J, D*B]
    chosen = flat_scores.topk(budget, dim=-1).indices  # flat ids d*B + slot
    chosen = chosen.sort(dim=-1).values  # depth-major, then beam order (= score order within a depth)
    n = budget + 1
    nodes = torch.arange(1, n, device=dev).expand(j, budget)
    node_of = torch.full((j, d_max * budget), -1, dtype=torch.int64, device=dev).scatter_(1, chosen, nodes)
    d_of = chosen // budget
    parent_flat = (d_of - 1) * budget + torch.stack(parents, dim=1).reshape(j, -1).gather(1, chosen)
    parent_node = torch.where(d_of == 0, 0, node_of.gather(1, parent_flat.clamp(min=0)))
    first = torch.zeros(j, 1, dtype=torch.int64, device=dev)
    root = torch.as_tensor(root_token, dtype=torch.int64, device=dev).expand(lead).reshape(j, 1)
    parents_all = torch.cat([first - 1, parent_node], dim=1)
    fields = (torch.cat([root, torch.stack(tokens, dim=1).reshape(j, -1).gather(1, chosen)], dim=1), parents_all,
              torch.cat([first, d_of + 1], dim=1),
              torch.cat([first == 0, torch.isfinite(flat_scores.gather(1, chosen))], dim=1))
    return DraftTree(*(f.reshape(*lead, n) for f in fields),
                     ancestors=ancestor_mask(parents_all, d_max).reshape(*lead, n, n))


def build_chain(logq: torch.Tensor, root_token: int | torch.Tensor) -> DraftTree:
    """DFlash's chain: the argmax at every depth (a tree with one node per depth); ``logq [..., D, V]`` and
    ``root_token`` as :func:`build_tree`."""
    *lead, d_max, _ = logq.shape
    dev, n = logq.device, d_max + 1
    root = torch.as_tensor(root_token, dtype=torch.int64, device=dev).expand(lead)[..., None]
    every = torch.ones(n, n, dtype=torch.bool, device=dev)

    def each(t: torch.Tensor) -> torch.Tensor:  # one copy per tree (a static output is written into on replay)
        return t.expand(*lead, *t.shape).clone()
    return DraftTree(tokens=torch.cat([root, logq.argmax(dim=-1)], dim=-1),
                     parents=each(torch.arange(-1, d_max, device=dev)), depth=each(torch.arange(n, device=dev)),
                     valid=each(every[0]), ancestors=each(every.tril()))


def build_tree_host(logq: torch.Tensor, root_token: int | torch.Tensor, budget: int) -> DraftTree:
    """The same selection by a best-first heap on the host: the reference for :func:`build_tree`, and the CPU
    builder (where there is no device to synchronise with, a few dozen heap operations beat D rounds of
    tensor ops). ``logq [D, V]`` → a DraftTree flattened as :func:`build_tree` flattens it (depth, then score
    descending); prefixes scoring −inf, and padding when fewer than ``budget`` exist, are invalid.

    Seed (depth 1, rank 0); each pop adds a node and pushes its next sibling (rank + 1) and its first child
    (depth + 1, rank 0): a child never scores above its parent, so pops come in score order."""
    d_max, vocab = logq.shape
    k = min(budget, vocab)
    top_lp, top_tok = logq.topk(k, dim=-1)
    lp, tok = top_lp.tolist(), top_tok.tolist()
    heap = [(-lp[0][0], 0, 0, -1)]  # (-score, depth index, rank, pop index of the parent; -1 = root)
    popped: list[tuple[int, float, int, int]] = []  # (depth index, -score, token, parent pop index)
    while heap and len(popped) < budget:
        neg_score, d, r, parent = heapq.heappop(heap)
        if neg_score == float("inf"):
            break  # everything left scores -inf
        popped.append((d, neg_score, tok[d][r], parent))
        if r + 1 < k:
            heapq.heappush(heap, (neg_score + lp[d][r] - lp[d][r + 1], d, r + 1, parent))
        if d + 1 < d_max:
            heapq.heappush(heap, (neg_score - lp[d + 1][0], d + 1, 0, len(popped) - 1))
    return _tree_of_pops(popped, root_token, budget, logq.device)[0]


def _tree_of_pops(popped: list[tuple], root_token, budget: int, device: torch.device) -> tuple[DraftTree, list[int]]:
    """The DraftTree of a best-first search's pops ``(depth, -score, token, parent pop, ...)``: nodes ordered by depth,
    then score, then pop, padded to ``budget``; and that order (the pop of node n + 1)."""
    order = sorted(range(len(popped)), key=lambda i: (popped[i][0], popped[i][1], i))
    node_of = {p: n + 1 for n, p in enumerate(order)}
    pad = budget - len(order)
    tokens = [int(root_token)] + [popped[p][2] for p in order] + [0] * pad
    parents = [-1] + [node_of.get(popped[p][3], 0) for p in order] + [0] * pad
    depth = [0] + [popped[p][0] + 1 for p in order] + [1] * pad
    rows: list[list[int]] = [[0]]  # each node's ancestors and itself (parents come first)
    for i in range(1, budget + 1):
        rows.append([*rows[parents[i]], i])
    ancestors = torch.zeros(budget + 1, budget + 1, dtype=torch.bool)
    ancestors[[i for i, r in enumerate(rows) for _ in r], [j for r in rows for j in r]] = True
    tree = DraftTree(tokens=torch.tensor(tokens, device=device), parents=torch.tensor(parents, device=device),
                     depth=torch.tensor(depth, device=device),
                     valid=torch.arange(budget + 1, device=device) <= len(order), ancestors=ancestors.to(device))
    return tree, order


def tree_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """The token paths of a DraftTree's valid non-root nodes (for comparing with the heap)."""
    toks, par, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    paths = []
    for i in range(len(toks)):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = par[j]
        paths.append(tuple(reversed(path)))
    return {p for i, p in enumerate(paths) if i > 0 and valid[i]}


def walk(tree: DraftTree, picks: torch.Tensor) -> torch.Tensor:
    """Accepted nodes: from the root, follow the child whose token equals the target's pick at its parent.

    ``picks [..., N]`` = the target's token at each node (argmax at T=0, a sample at T>0) of ``tree`` (one
    tree, or a batch with the same leading dims). A node is accepted when it and all its ancestors below
    the root match. Returns ``[..., N]`` bool; the accepted nodes form one root path (siblings carry distinct
    tokens)."""
    match = (tree.tokens == picks.gather(-1, tree.parents.clamp(min=0))) & tree.valid
    match[..., 0] = True
    return ~(tree.ancestors & ~match[..., None, :]).any(dim=-1)


def path_by_depth(tree: DraftTree, accepted: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted root path (:func:`walk`) as fixed-shape indices: ``(path [..., L], count [...])`` with
    ``path[..., d]`` the accepted node at depth d for ``d < count`` and ``d`` itself beyond (so a gather/scatter
    over all L entries is a no-op past the path), ``count`` the path's length (root included). ``length`` L
    must exceed the deepest node (``SpecConfig.draft_rows + 1``). No host synchronisation.

    The committed tokens of a step are ``picks.gather(-1, path)[..., :count]``: the pick at each path node
    is its accepted child's token, and at the last node the bonus."""
    *lead, n = accepted.shape
    spill = torch.full_like(tree.depth, length)  # not-accepted nodes scatter into a column that is dropped
    path = torch.arange(length + 1, device=accepted.device).expand(*lead, length + 1).clone()
    nodes = torch.arange(n, device=accepted.device).expand(*lead, n)
    path.scatter_(-1, torch.where(accepted, tree.depth, spill), nodes)
    return path[..., :length], accepted.sum(dim=-1)


def build_tree_grammar(logq: torch.Tensor, root_token: int, budget: int, grammar, masks: torch.Tensor,
                       chain: bool = False, prune: bool = True) -> tuple[DraftTree, int]:
    """A constrained request's tree, built on the host under its grammar (``grammar``: an
    :class:`engine.sampling.logits_processors.GrammarWalk` at the request's committed state): :func:`build_tree_host`'s
    best-first selection (``chain``: DFlash's argmax chain) where each node's children are the drafter's best tokens
    *that the grammar allows after that node* — the matcher is walked over the tree (accept the node's path, fill its
    mask, roll back), and the same walk writes every node's mask into ``masks [N, W]`` int32 (the verify samples each
    node under it; -1 rows: every token). Children are not grown under a stop token. ``prune`` off: the plain tree
    (its nodes' masks still filled; a node the grammar forbids gets -1, and the walk never reaches it). ``logq [D,
    V]`` on the host. Returns the tree and the candidates the grammar removed (tokens of the plain top-k lists of the
    nodes expanded that it forbids)."""
    d_max, vocab = logq.shape
    if chain:
        return _chain_grammar(logq, root_token, grammar, masks, prune)
    k = min(budget, vocab)
    pop_masks = torch.full((budget + 1, masks.shape[-1]), -1, dtype=torch.int32)
    grammar.fill([], pop_masks[budget])  # the root's, kept in the last row until the flattening
    pruned = 0

    tops = [logq[d].topk(min(SHORTLIST * k, vocab)) for d in range(d_max)]  # each depth's best, unmasked

    def candidates(mask: torch.Tensor, d: int) -> tuple[list[float], list[int]]:
        """The node's children: the drafter's best ``k`` tokens at depth ``d`` that ``mask`` allows — looked up in
        the depth's shortlist first (bits of a few ids), the whole vocabulary only when the shortlist has too few."""
        nonlocal pruned
        top_lp, top_tok = tops[d]
        if not prune:
            return top_lp[:k].tolist(), top_tok[:k].tolist()
        ok = ((mask[top_tok >> 5] >> (top_tok & 31).to(torch.int32)) & 1).bool()
        pruned += int((~ok[:k]).sum())
        if int(ok.sum()) >= k or top_tok.numel() == vocab:
            lp, tok = top_lp[ok][:k], top_tok[ok][:k]
        else:
            ids = _allowed(mask, vocab).nonzero().squeeze(1)
            best = logq[d][ids].topk(min(k, ids.numel()))
            lp, tok = best.values, ids[best.indices]
        keep = torch.isfinite(lp)
        return lp[keep].tolist(), tok[keep].tolist()

    cands = {-1: candidates(pop_masks[budget], 0)}
    heap = [(-cands[-1][0][0], 0, 0, -1)] if cands[-1][0] else []
    popped: list[tuple[int, float, int, int, list[int]]] = []  # (depth index, -score, token, parent pop, path)
    while heap and len(popped) < budget:
        neg_score, d, r, parent = heapq.heappop(heap)
        if neg_score == float("inf"):
            break
        lps, toks = cands[parent]
        token = toks[r]
        path = (popped[parent][4] if parent >= 0 else []) + [token]
        me = len(popped)
        popped.append((d, neg_score, token, parent, path))
        ok = grammar.fill(path, pop_masks[me])
        if r + 1 < len(toks):
            heapq.heappush(heap, (neg_score + lps[r] - lps[r + 1], d, r + 1, parent))
        if d + 1 < d_max and not grammar.ends(token) and (ok or not prune):
            cands[me] = candidates(pop_masks[me], d + 1)
            if cands[me][0]:
                heapq.heappush(heap, (neg_score - cands[me][0][0], d + 1, 0, me))
    tree, order = _tree_of_pops(popped, root_token, budget, torch.device("cpu"))
    masks.fill_(-1)
    masks[0] = pop_masks[budget]
    for n, p in enumerate(order):
        masks[n + 1] = pop_masks[p]
    return tree, pruned


def _chain_grammar(logq: torch.Tensor, root_token: int, grammar, masks: torch.Tensor,
                   prune: bool) -> tuple[DraftTree, int]:
    """:func:`build_tree_grammar` for DFlash's chain: at each depth the drafter's best token the grammar allows
    after the chain so far (``prune`` off: its argmax); the chain ends (invalid nodes) at a stop token or where the
    grammar allows nothing the drafter scores."""
    d_max, vocab = logq.shape
    n, path, pruned = d_max + 1, [], 0
    tokens, valid = [int(root_token)] + [0] * d_max, [True] + [False] * d_max
    masks.fill_(-1)
    ok = grammar.fill([], masks[0])
    for d in range(d_max):
        if not ok and prune:
            break
        scores = logq[d]
        if prune:
            allowed = _allowed(masks[d], vocab)
            pruned += int(not allowed[scores.argmax()])
            scores = scores.masked_fill(~allowed, float("-inf"))
            if not torch.isfinite(scores.max()):
                break
        token = int(scores.argmax())
        tokens[d + 1], valid[d + 1] = token, True
        path.append(token)
        ok = grammar.fill(path, masks[d + 1])
        if grammar.ends(token):
            break
    every = torch.ones(n, n, dtype=torch.bool)
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.arange(-1, d_max), depth=torch.arange(n),
                     valid=torch.tensor(valid), ancestors=every.tril()), pruned


def _allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """One int32 bitmask row ``[W]`` → ``[vocab]`` bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((mask[:, None] >> shifts) & 1).bool().reshape(-1)[:vocab]
