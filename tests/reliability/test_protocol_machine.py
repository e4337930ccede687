"""The CI version of the soak: the model-based cache-protocol machine (``protocol_machine``)
for a few dozen examples, the soak runner (``soak``) and its entry point, and regressions the
machine found (kept as plain tests)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockTrie
from hybridcache.sequence import Sequence

from tests.prefix_cache._helpers import admit, forward
from tests.reliability.protocol_machine import CacheProtocolMachine
from tests.reliability.soak import run_soak

REPOSITORY = Path(__file__).resolve().parents[2]

TestCacheProtocol = CacheProtocolMachine.TestCase
TestCacheProtocol.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def test_run_soak_counts_steps_and_finds_no_violation():
    out = io.StringIO()
    report = run_soak(1.0, seed=1234, out=out)
    assert report.violations == 0, out.getvalue()
    assert report.steps > 50 and report.examples >= 2 and report.batches >= 1
    assert report.summary() == f"steps executed: {report.steps}, violations: 0"


def test_run_soak_reports_a_violation(monkeypatch):
    """A cache that leaks on clear is caught, counted and printed with its failing steps."""
    monkeypatch.setattr(BlockTrie, "clear", lambda self: 0)
    out = io.StringIO()
    report = run_soak(0.5, seed=99, out=out)
    assert report.violations >= 1 and len(report.failures) == report.violations
    text = out.getvalue()
    assert "violation 1" in text and "AssertionError" in text and "state.setup(" in text and "state.teardown()" in text
    assert report.summary().endswith(f"violations: {report.violations}")


def test_soak_entry_point_prints_steps_and_violations():
    """What ``make soak`` runs, for one second: the last line counts steps and violations."""
    env = dict(os.environ, SOAK_SECONDS="1", SOAK_SEED="5")
    done = subprocess.run(
        [sys.executable, "-m", "tests.reliability.soak"],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPOSITORY,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("steps executed: ") and last.endswith(", violations: 0")
    assert int(last.split(":")[1].split(",")[0]) > 0


def test_the_core_package_never_imports_hypothesis():
    """hypothesis is a dev dependency: no module under src/ imports it, and importing every
    public package of hybridcache leaves it unloaded."""
    package = REPOSITORY / "src" / "hybridcache"
    importers = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if any(line.lstrip().startswith(("import hypothesis", "from hypothesis")) for line in path.read_text().splitlines())
    ]
    assert importers == []
    code = (
        "import sys, hybridcache, hybridcache.cli, hybridcache.demo, hybridcache.engine, hybridcache.scheduler, "
        "hybridcache.prefix_cache, hybridcache.memory, hybridcache.config, hybridcache.errors\n"
        "assert 'hypothesis' not in sys.modules, sorted(m for m in sys.modules if m.startswith('hypothesis'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# --- regressions found by the machine ---------------------------------------------------------------


def test_a_resumed_match_never_restores_below_pending_ancestors():
    """With pending nodes (the engine's mode), a session resuming into a checkpoint whose anchor
    lies below nodes nobody computed yet must not hit it: the hit used to move the session's
    step to the checkpoint without handing it the blocks in between (found by the soak)."""
    block = 4
    pool = BlockPool(32)
    trie = BlockTrie(pool, block, state_pool=StatePool(8, checkpoint_budget=3), track_pending=True)
    cp = trie.checkpoints

    def run(seq: Sequence) -> None:  # the forward, then its nodes become matchable
        start = seq.num_computed
        forward(trie, seq)
        trie.mark_computed(seq, start)

    waiting = Sequence(list(range(1, 11)))  # admitted, never ran: blocks 0-1 stay pending
    admit(trie, waiting)
    session = Sequence(list(range(1, 11)) + [0])  # runs on private copies of those blocks
    admit(trie, session)
    run(session)
    ahead = Sequence(list(range(1, 11)) + [0, 0])  # attaches block 2 below them and saves at 12
    admit(trie, ahead)
    assert cp.reserve_save(ahead, 12) > 0
    run(ahead)
    assert cp.publish_save(ahead)
    session.append_tokens([0, 0])
    table = session.block_table.copy()
    txn = trie.match(session)
    if txn.hit_tokens:  # a hit must hand over the canonical blocks up to the checkpoint
        assert session.num_computed == 12 and session.block_table[2] == ahead.block_table[2]
    else:
        assert session.num_computed == 11 and (session.block_table == table).all()
    trie.rollback(txn)
    trie.check_invariants([waiting, session, ahead])


def test_a_colliding_keyer_never_hides_deeper_checkpoints_from_a_fresh_request():
    """The shrunk 600 s soak failure (issue 19, item 24), step by step: under colliding keys a
    fresh request with more than a few candidate steps first asks whether its first block is
    cached; that key was made by another derivation than the stored keys, read "not cached",
    and the search dropped every step beyond the first block ("missed exact published
    checkpoints at [10, 11, 16, 18, 20]"; or "hit at 1, not the deepest")."""
    machine = CacheProtocolMachine()
    request = dict(choice=None, evict=True, in_flight=False, index=0, pin=False, recompute=0, save=False, wild=False)
    converse = dict(
        choice=None, follow_up=(0, [0], False, None), in_flight=False, pin=False, recompute=0, stop="published"
    )
    base = ("base", (0, 1, [], 0, None))
    steps = [
        lambda: machine.setup(hybrid=True, pending=True, colliding=True),
        lambda: machine.request(source=("follow_up", (0, [0], False, None)), stop="published", **request),
        lambda: machine.free(index=0),
        lambda: machine.create(recompute=0, source=base),
        lambda: machine.match(index=0),
        lambda: machine.converse(**converse),
        lambda: machine.request(source=None, stop="published", **request),
        lambda: machine.decode(evict=False, follow=None, in_flight=False, index=0, pin=False, tokens=[0, 0, 0, 0, 0]),
        lambda: machine.create(recompute=0, source=base),
        lambda: machine.resume(admit=True, evict=False, follow=None, index=0, tokens=[0]),
        lambda: machine.forward(index=0),
        lambda: machine.overtake(admit=False, beyond=[0], extra=[0], index=0, step=None),
        lambda: machine.resume(admit=True, evict=False, follow=None, index=0, tokens=[0]),
        lambda: machine.free(index=0),
        lambda: machine.converse(**converse),
        lambda: machine.overtake(admit=True, beyond=[0], extra=[0], index=0, step=None),
    ]
    for step in steps:
        step()
        machine.consistent()
    assert machine.hybrid and machine.published, "the scenario published checkpoints for its matches to find"
    machine.teardown()
