"""The routing policies of `serve --replicas` (serve/routing.py) without Ray: a document's
questions stay on the replica that was sent it, new documents spread by their leading tokens'
hash and move only with their replica, a saturated replica gives way to the least loaded; and
`--replicas` without Ray is refused in one line naming the install command."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from specextend.serve.routing import BLOCK, HASH_TOKENS, MIN_MATCH, Affinity, Load, RoundRobin, owner

REPLICAS = ["r1", "r2", "r3"]


def loads(**in_flight: int) -> dict[str, Load]:
    return {r: Load(in_flight.get(r, 0), capacity=4, imbalance=2) for r in REPLICAS}


def doc(seed: int, n: int = 10 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_documents_questions_follow_the_replica_that_was_sent_it():
    policy = Affinity()
    document = doc(0)
    home = owner(document, REPLICAS)
    elsewhere = next(r for r in REPLICAS if r != home)
    policy.routed([*document, 1, 2, 3], elsewhere)  # sent elsewhere once (say its home was busy)
    for question in ([7, 8], [9, 10, 11], []):
        ranked = policy.choose([*document, *question], loads())
        assert ranked[0] == elsewhere and sorted(ranked) == REPLICAS
    assert policy.matches([*document, 5], REPLICAS)[elsewhere] == len(document)


def test_new_documents_spread_by_their_leading_tokens_and_move_only_with_their_replica():
    policy = Affinity()
    docs = [doc(s) for s in range(60)]
    first = {i: policy.choose(d, loads())[0] for i, d in enumerate(docs)}
    assert set(first.values()) == set(REPLICAS)  # all replicas get some
    # The same leading tokens, another tail: the same replica, with no memory at all.
    assert all(policy.choose([*d[:HASH_TOKENS], 1, 2], loads())[0] == first[i] for i, d in enumerate(docs))
    # r3 leaves: only its documents move.
    two = {r: Load(0, 4, 2) for r in ("r1", "r2")}
    for i, d in enumerate(docs):
        if first[i] != "r3":
            assert policy.choose(d, two)[0] == first[i]


def test_a_saturated_replica_gives_way_to_the_least_loaded():
    policy = Affinity()
    document = doc(1)
    policy.routed(document, "r1")
    assert policy.choose(document, loads(r1=1))[0] == "r1"  # busy, but the prefill elsewhere costs more
    assert policy.choose(document, loads(r1=2))[0] != "r1"  # 2 above the least loaded: imbalance
    assert policy.choose(document, loads(r1=4, r2=4, r3=3))[0] == "r3"  # at capacity
    assert policy.choose(document, loads(r1=3, r2=3, r3=3))[0] == "r1"  # all equally busy: its home


@pytest.mark.parametrize("shared", [BLOCK - 1, MIN_MATCH - 1])
def test_a_short_shared_run_is_no_affinity(shared):
    """A chat template's header, a short system prompt: new documents after it spread as before."""
    header = doc(2, shared)
    for s in range(10, 40):
        policy = Affinity()
        policy.routed([*header, *doc(3)], "r1")
        fresh = [*header, *doc(s)]
        assert policy.choose(fresh, loads())[0] == owner(fresh, REPLICAS)
        if owner(fresh, REPLICAS) != "r1":
            return
    pytest.fail("every document hashed to r1")


def test_among_replicas_that_hold_a_prompt_the_least_loaded_takes_it():
    policy = Affinity()
    system = doc(7, 2 * MIN_MATCH)  # a long system prompt both replicas hold
    policy.routed([*system, 1], "r1")
    policy.routed([*system, 2], "r2")
    assert policy.choose([*system, 3], loads(r1=1, r3=0))[0] == "r2"
    assert policy.choose([*system, 3], loads(r2=1))[0] == "r1"


def test_a_replica_that_left_is_forgotten():
    policy = Affinity()
    document = doc(5)
    policy.routed(document, "r2")
    policy.forget("r2")
    assert policy.matches(document, REPLICAS) == dict.fromkeys(REPLICAS, 0)
    assert policy.choose(document, {r: Load(0, 4, 2) for r in ("r1", "r3")})[0] in ("r1", "r3")


def test_memory_is_bounded():
    policy = Affinity(max_blocks=8)
    for s in range(5):
        policy.routed(doc(s), "r1")
    assert len(policy._seen) == 8


def test_round_robin_takes_each_replica_in_turn_whatever_the_prompt():
    policy = RoundRobin()
    document = doc(6)
    assert [policy.choose(document, loads())[0] for _ in range(6)] == REPLICAS * 2


@pytest.mark.parametrize("args, needle", [
    (["--replicas", "2"], "pip install -e '.[cluster]'"),
    (["--ray-address", "auto"], "--ray-address needs --replicas"),
    (["--routing", "round-robin"], "--routing needs --replicas"),
])
def test_replica_flags_without_ray_or_replicas_are_refused_in_one_line(args, needle, tmp_path):
    """Ray is hidden from the command (as where the extra is not installed)."""
    code = ("import sys; sys.modules['ray'] = None; from specextend.cli.main import main; "
            f"sys.exit(main(['serve', *{args!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"SPECEXTEND_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr and "Traceback" not in r.stderr
