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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..common.settings import Settings

# Runs the draft on new tree nodes: (tokens [T], depths [T], mask [T, M] over the M tree nodes
# fed so far, these included) -> logits [T, V].
DraftRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Who proposed a node (bits: a node several proposed has each): the draft, prompt lookup, or the
# grammar that forces it (sampling/logits_process.py). Lookup's and the grammar's are deterministic.
DRAFT, LOOKUP, FORCED = 1, 2, 4
FIXED = LOOKUP | FORCED


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N+1] long; tokens[0] is the root
    parents: list[int]  # parents[0] = -1
    depths: torch.Tensor  # [N+1] long; root depth 0
    children: list[list[int]]  # per node: the draft's children, in draw order (drawn from q[node])
    q: dict[int, torch.Tensor]  # per node with draft children: the draft distribution they came from
    # Per node: deterministic children (prompt lookup), in proposal order. Verification tries them
    # before the draft's children (verify.py); a node both proposed appears in both lists.
    fixed: list[list[int]] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)  # per node: DRAFT | LOOKUP bits (root: 0)

    def __post_init__(self) -> None:
        if not self.fixed:
            self.fixed = [[] for _ in self.parents]
        if not self.origin:
            self.origin = [0] + [DRAFT] * (len(self.parents) - 1)

    @property
    def size(self) -> int:
        return len(self.parents)

    def successors(self, node: int) -> list[int]:
        """Every child of `node` (each token once)."""
        return self.fixed[node] + [c for c in self.children[node] if c not in self.fixed[node]]

    def mask(self) -> torch.Tensor:
        """[N+1, N+1] ancestor-or-self mask for the verification forward."""
        n = self.size
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            m[i] = m[self.parents[i]] if i else m[i]
            m[i, i] = True
        return m


@dataclass
class Pool:
    """Candidate nodes below the root, before the tree is chosen; parent -1 is the root.

    Draft candidates are appended in creation order, so siblings stand in draw order; their
    `score` is the product of rank probabilities along the path (see `pick_children`). Lookup
    candidates form a trie of continuations; the sizer values them (sizing.py)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    ngram: list[int] = field(default_factory=list)  # lookup: suffix tokens matched; draft: 0
    alt: list[bool] = field(default_factory=list)  # lookup: not its parent's first lookup child
    dists: dict[int, torch.Tensor] = field(default_factory=dict)  # expanded draft nodes' q; -1: root
    expanded: list[int] = field(default_factory=list)  # draft nodes fed to the draft, in order

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, origin: int, score: float = 0.0, ngram: int = 0, alt: bool = False
            ) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        self.origin.append(origin)
        self.score.append(score)
        self.ngram.append(ngram)
        self.alt.append(alt)
        return len(self.tokens) - 1

    def add_continuation(self, tokens: Sequence[int], ngram: int, origin: int = LOOKUP) -> None:
        """A lookup (or forced) branch below the root, sharing the prefix it has in common with
        earlier ones of the same origin."""
        parent = -1
        for t in tokens:
            kids = [i for i in range(len(self)) if self.parents[i] == parent and self.origin[i] == origin]
            same = next((i for i in kids if self.tokens[i] == t), None)
            parent = same if same is not None else self.add(t, parent, origin, ngram=ngram, alt=bool(kids))

    def extend(self, parent: int, tokens: Sequence[int], origin: int) -> None:
        """A chain of candidates below `parent` (-1: the root)."""
        for t in tokens:
            parent = self.add(t, parent, origin, ngram=self.ngram[parent] if parent >= 0 else 0)

    def leaves(self, origin: int) -> list[int]:
        """The candidates of `origin` without children."""
        parents = set(self.parents)
        return [i for i in range(len(self)) if self.origin[i] == origin and i not in parents]

    def path(self, i: int) -> list[int]:
        """The tokens from below the root down to candidate i (-1: none)."""
        out: list[int] = []
        while i >= 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return out[::-1]

    def of(self, origin: int) -> list[int]:
        return [i for i in range(len(self)) if self.origin[i] == origin]


def assemble(root: int, pool: Pool, keep: Sequence[int], node_of: dict[int, int] | None = None) -> DraftTree:
    """The tree of the kept candidates (closed under parents), parents numbered first; `node_of`,
    if given, is filled with each kept candidate's tree node (-1, the root, is node 0).

    A lookup and a draft candidate with the same parent and token become one node: it is tried
    first as the lookup's (fixed) child, and still stands among the draft's children in its draw
    position, where verification under sampling must account for it (see verify.py)."""
    tokens, parents, depths = [root], [-1], [0]
    children: list[list[int]] = [[]]
    fixed: list[list[int]] = [[]]
    origin = [0]
    node_of = {} if node_of is None else node_of
    node_of[-1] = 0
    by_key: dict[tuple[int, int], int] = {}
    draft_q = {0: pool.dists.get(-1)}
    for i in sorted(keep, key=lambda i: (pool.depths[i], i)):  # same depth: creation (= draw) order
        if pool.parents[i] not in node_of:
            raise ValueError(f"candidate {i} is kept without its parent")
        up = node_of[pool.parents[i]]
        node = by_key.get((up, pool.tokens[i]))
        if node is None:
            node = len(tokens)
            by_key[(up, pool.tokens[i])] = node
            tokens.append(pool.tokens[i])
            parents.append(up)
            depths.append(depths[up] + 1)
            children.append([])
            fixed.append([])
            origin.append(0)
        node_of[i] = node
        origin[node] |= pool.origin[i]
        if pool.origin[i] & FIXED:
            if node not in fixed[up]:
                fixed[up].append(node)
        else:
            children[up].append(node)
            if i in pool.dists:
                draft_q[node] = pool.dists[i]
    return DraftTree(
        tokens=torch.tensor(tokens),
        parents=parents,
        depths=torch.tensor(depths),
        children=children,
        q={n: draft_q[n] for n in range(len(tokens)) if children[n]},
        fixed=fixed,
        origin=origin,
    )


def draft_dist(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The draft's proposal distribution q (float64 for the acceptance arithmetic)."""
    logits = logits.double()
    return torch.softmax(logits / temperature if temperature > 0 else logits, dim=-1)


def pick_children(
    q: torch.Tensor, k: int, greedy: bool, rng: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k candidate tokens from q, and the scores the tree shape may use for them.

    Greedy: the top-k tokens. Sampling: a draw of k tokens without replacement, in draw order:
    the k largest q_i / E_i with E_i ~ Exp(1) (an exponential race, Gumbel-top-k without its two
    logarithms over the vocabulary: log q_i - log E_i orders the tokens the same way). Either
    way the j-th child's score is the j-th largest probability of q, never the drawn token's own
    probability: whether a sampled child stays in the tree must not depend on which token it is,
    or the kept children would no longer be draws from q and rejection sampling would lose
    exactness. (In greedy mode the two are the same numbers.)
    """
    probs, top = torch.topk(q, min(k, int(torch.count_nonzero(q))))
    if greedy:
        return top, probs
    # E = 0 would make its token win whatever its probability (a draw of u = 1, rounded): floored.
    race = torch.empty(q.shape, dtype=torch.float64).exponential_(generator=rng).clamp_(min=1e-300)
    return torch.topk(q / race, probs.numel()).indices, probs


# Asked before each further draft level: (pool so far, the nodes the level would expand, the
# level's depth) -> whether to run it. The sizer answers from the cost model (sizing.py).
KeepGoing = Callable[[Pool, list[int], int], bool]


class TreeBuilder:
    """Interface: grow draft candidates below a root whose draft distribution is `root_q`."""

    def grow(self, pool: Pool, root_q: torch.Tensor, run: DraftRunner, greedy: bool, temperature: float,
             rng: torch.Generator | None, keep_going: KeepGoing | None = None) -> None:
        """Add the draft's candidates to `pool`, one draft forward per level after the first."""
        raise NotImplementedError

    def select(self, pool: Pool) -> list[int]:
        """The draft candidates a fixed-size tree keeps (without the sizer)."""
        raise NotImplementedError

    def build(self, root: int, root_q: torch.Tensor, run: DraftRunner, greedy: bool, temperature: float,
              rng: torch.Generator | None) -> DraftTree:
        """Grow the whole tree and keep `select`'s nodes: the fixed-size tree of `sd`."""
        pool = Pool()
        self.grow(pool, root_q, run, greedy, temperature, rng)
        return assemble(root, pool, self.select(pool))


class DynamicTreeBuilder(TreeBuilder):
    """EAGLE-2-style dynamic tree.

    Each level expands the `topk` frontier nodes with the highest path probability (product of
    draft probabilities from the root) in one draft forward; each expanded node proposes `topk`
    children. Growth stops at `depth`, when the best frontier path probability falls below
    `threshold`, or when `keep_going` says no. `select` keeps the `budget` nodes with the highest
    path probability: a node's path probability never exceeds its parent's, and a child never
    outranks an earlier sibling (scores are by rank, see `pick_children`), so the kept set is a
    tree whose sibling lists are prefixes of the draw order (what recursive rejection sampling
    needs). In sampling mode no decision here looks at which tokens were drawn, only at ranks.
    """

    def __init__(self, budget: int, depth: int, topk: int, threshold: float = 0.0) -> None:
        self.budget, self.depth, self.topk, self.threshold = budget, depth, topk, threshold

    def grow(self, pool, root_q, run, greedy, temperature, rng, keep_going=None) -> None:
        def add_children(node: int, q: torch.Tensor) -> list[int]:
            pool.dists[node] = q
            c_tok, c_p = pick_children(q, self.topk, greedy, rng)
            base = pool.score[node] if node >= 0 else 1.0
            return [pool.add(t, node, DRAFT, score=base * p) for t, p in zip(c_tok.tolist(), c_p.tolist(), strict=True)]

        frontier = add_children(-1, root_q)
        for level in range(1, self.depth):
            expand = sorted(frontier, key=lambda i: (-pool.score[i], i))[: self.topk]
            if not expand or pool.score[expand[0]] < self.threshold:
                break
            if keep_going is not None and not keep_going(pool, expand, level + 1):
                break
            pool.expanded.extend(expand)
            slot = {node: i for i, node in enumerate(pool.expanded)}
            # Built as lists and made a tensor once: an element store a tensor costs microseconds.
            rows = [[False] * len(pool.expanded) for _ in expand]
            for r, node in enumerate(expand):
                j = node
                while j >= 0:  # the root is already committed in the draft's cache
                    rows[r][slot[j]] = True
                    j = pool.parents[j]
            mask = torch.tensor(rows, dtype=torch.bool)
            logits = run(torch.tensor([pool.tokens[i] for i in expand]),
                         torch.tensor([pool.depths[i] for i in expand]), mask)
            frontier = []
            for r, node in enumerate(expand):
                frontier.extend(add_children(node, draft_dist(logits[r], temperature)))

    def select(self, pool: Pool) -> list[int]:
        return sorted(pool.of(DRAFT), key=lambda i: (-pool.score[i], i))[: self.budget]


class ChainBuilder(DynamicTreeBuilder):
    """k draft tokens in a row: the classic speculative decoding proposal (a tree of width 1)."""

    def __init__(self, length: int) -> None:
        super().__init__(budget=length, depth=length, topk=1)
        self.length = length


def make_builder(s: Settings) -> TreeBuilder:
    if s.tree == "chain":
        return ChainBuilder(s.chain_length)
    return DynamicTreeBuilder(s.tree_budget, s.tree_depth, s.tree_topk, s.tree_threshold)
