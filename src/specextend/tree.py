"""Draft tree builders: a chain of k tokens, and a dynamic tree in the manner of EAGLE-2/OPT-Tree.

A builder grows a tree of draft tokens below a root (the last committed token) by calling the
draft model level by level through a `DraftRunner`, then returns a `DraftTree` in the layout the
verifier and the target forward need: node 0 is the root, every parent comes before its children.

Children are chosen two ways:
- greedy decoding: the draft's top-k tokens, most likely first;
- sampling: k tokens drawn *without replacement* from the draft distribution q (Gumbel-top-k),
  in draw order. The verifier's recursive rejection sampling relies on that order and on q.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .settings import Settings

# Runs the draft on new tree nodes: (tokens [T], depths [T], mask [T, M] over the M tree nodes
# fed so far, these included) -> logits [T, V].
DraftRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N+1] long; tokens[0] is the root
    parents: list[int]  # parents[0] = -1
    depths: torch.Tensor  # [N+1] long; root depth 0
    children: list[list[int]]  # per node, in draw order
    q: dict[int, torch.Tensor]  # per node with children: the draft distribution they came from

    @property
    def size(self) -> int:
        return len(self.parents)

    def mask(self) -> torch.Tensor:
        """[N+1, N+1] ancestor-or-self mask for the verification forward."""
        n = self.size
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            m[i] = m[self.parents[i]] if i else m[i]
            m[i, i] = True
        return m


def draft_dist(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The draft's proposal distribution q (float64 for the acceptance arithmetic)."""
    logits = logits.double()
    return torch.softmax(logits / temperature if temperature > 0 else logits, dim=-1)


def pick_children(
    q: torch.Tensor, k: int, greedy: bool, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k candidate tokens from q, and the scores the tree shape may use for them.

    Greedy: the top-k tokens. Sampling: a draw of k tokens without replacement, in draw order
    (Gumbel-top-k). Either way the j-th child's score is the j-th largest probability of q,
    never the drawn token's own probability: whether a sampled child stays in the tree must
    not depend on which token it is, or the kept children would no longer be draws from q and
    rejection sampling would lose exactness. (In greedy mode the two are the same numbers.)
    """
    probs, top = torch.topk(q, min(k, int((q > 0).sum())))
    if greedy:
        return top, probs
    u = torch.rand(q.shape, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    keys = torch.log(q) - torch.log(-torch.log(u))
    return torch.topk(keys, probs.numel()).indices, probs


class TreeBuilder:
    """Interface: grow a tree below `root` whose draft distribution is `root_q`."""

    def build(self, root: int, root_q: torch.Tensor, run: DraftRunner, greedy: bool,
              temperature: float, gen: torch.Generator | None) -> DraftTree:
        raise NotImplementedError


class ChainBuilder(TreeBuilder):
    """k draft tokens in a row: the classic speculative decoding proposal."""

    def __init__(self, length: int) -> None:
        self.length = length

    def build(self, root, root_q, run, greedy, temperature, gen) -> DraftTree:
        tokens, q = [root], {0: root_q}
        dist = root_q
        for d in range(1, self.length + 1):
            tok, _ = pick_children(dist, 1, greedy, gen)
            tokens.append(int(tok[0]))
            if d == self.length:
                break
            mask = torch.ones(1, d, dtype=torch.bool)
            logits = run(tok, torch.tensor([d]), mask)
            dist = draft_dist(logits[0], temperature)
            q[d] = dist
        n = len(tokens)
        return DraftTree(
            tokens=torch.tensor(tokens),
            parents=[-1, *range(n - 1)],
            depths=torch.arange(n),
            children=[[i + 1] for i in range(n - 1)] + [[]],
            q=q,
        )


class DynamicTreeBuilder(TreeBuilder):
    """EAGLE-2-style dynamic tree.

    Each level expands the `topk` frontier nodes with the highest path probability (product of
    draft probabilities from the root) in one draft forward; each expanded node proposes `topk`
    children. Growth stops at `depth` or when the best frontier path probability falls below
    `threshold`. Finally the `budget` nodes with the highest path probability are kept: a node's
    path probability never exceeds its parent's, and a child never outranks an earlier sibling
    (scores are by rank, see `pick_children`), so the kept set is a tree whose sibling lists are
    prefixes of the draw order (what recursive rejection sampling needs).
    """

    def __init__(self, budget: int, depth: int, topk: int, threshold: float = 0.0) -> None:
        self.budget, self.depth, self.topk, self.threshold = budget, depth, topk, threshold

    def build(self, root, root_q, run, greedy, temperature, gen) -> DraftTree:
        toks: list[int] = [root]
        parents: list[int] = [-1]
        depth: list[int] = [0]
        score: list[float] = [1.0]
        dists: dict[int, torch.Tensor] = {0: root_q}
        fed: list[int] = []  # tree nodes fed to the draft, in feeding order (their cache slots)

        def add_children(node: int, q: torch.Tensor) -> list[int]:
            c_tok, c_p = pick_children(q, self.topk, greedy, gen)
            new = []
            for t, p in zip(c_tok.tolist(), c_p.tolist(), strict=True):
                toks.append(t)
                parents.append(node)
                depth.append(depth[node] + 1)
                score.append(score[node] * p)
                new.append(len(toks) - 1)
            return new

        frontier = add_children(0, root_q)
        for _ in range(1, self.depth):
            expand = sorted(frontier, key=lambda i: -score[i])[: self.topk]
            if not expand or score[expand[0]] < self.threshold:
                break
            fed.extend(expand)
            slot = {node: i for i, node in enumerate(fed)}
            mask = torch.zeros(len(expand), len(fed), dtype=torch.bool)
            for r, node in enumerate(expand):
                j = node
                while j > 0:  # the root is already committed in the draft's cache
                    mask[r, slot[j]] = True
                    j = parents[j]
            logits = run(torch.tensor([toks[i] for i in expand]), torch.tensor([depth[i] for i in expand]), mask)
            frontier = []
            for r, node in enumerate(expand):
                q = draft_dist(logits[r], temperature)
                dists[node] = q
                frontier.extend(add_children(node, q))

        # Keep the best `budget` nodes (plus the root), then renumber parents-first.
        ranked = sorted(range(1, len(toks)), key=lambda i: (-score[i], i))[: self.budget]
        keep = sorted(ranked, key=lambda i: (depth[i], i))
        new_id = {0: 0}
        for i in keep:
            new_id[i] = len(new_id)
        children: list[list[int]] = [[] for _ in range(len(new_id))]
        for i in sorted(keep):  # sorted old ids = creation order = draw order among siblings
            children[new_id[parents[i]]].append(new_id[i])
        order = [0, *keep]
        return DraftTree(
            tokens=torch.tensor([toks[i] for i in order]),
            parents=[-1] + [new_id[parents[i]] for i in keep],
            depths=torch.tensor([depth[i] for i in order]),
            children=children,
            q={new_id[i]: d for i, d in dists.items() if i in new_id and children[new_id[i]]},
        )


def make_builder(s: Settings) -> TreeBuilder:
    if s.tree == "chain":
        return ChainBuilder(s.chain_length)
    return DynamicTreeBuilder(s.tree_budget, s.tree_depth, s.tree_topk, s.tree_threshold)
