"""actors/collector.py, the daemon's garbage-collector policy, in this process: garbage is collected before
anything is frozen, what is frozen is out of a full collection's reach, and `settle` frees cycles that died
frozen. (In a daemon: a full collection walked its 100-130k objects for 55-130 ms in the middle of a step.)"""

import gc
import weakref

import pytest

from actors import collector


class Node:
    pass


def cycle() -> weakref.ref:
    n = Node()
    n.me = n
    return weakref.ref(n)


@pytest.fixture
def thawed():
    yield
    gc.unfreeze()  # (the rest of the test session is collected as usual)


def test_freeze_collects_first_keeps_the_frozen_out_of_full_collections_and_settle_frees_dead_frozen_cycles(thawed, monkeypatch):
    monkeypatch.delenv("MPMD_GC_FREEZE", raising=False)
    dead = cycle()  # garbage already: collected by freeze, never frozen
    collector.freeze()
    assert dead() is None and gc.get_freeze_count() > 0
    keeper = Node()
    keeper.me = keeper
    kept = weakref.ref(keeper)
    collector.freeze()
    before = len(gc.get_objects())
    del keeper  # now a dead cycle, but frozen
    gc.collect()
    assert kept() is not None  # a full collection does not walk what is frozen
    assert len(gc.get_objects()) <= before
    collector.settle()
    assert kept() is None and gc.get_freeze_count() > 0  # thawed, collected, the living frozen again


def test_mpmd_gc_freeze_0_leaves_the_collector_alone(thawed, monkeypatch):
    monkeypatch.setenv("MPMD_GC_FREEZE", "0")
    gc.unfreeze()
    collector.freeze()
    collector.settle()
    assert gc.get_freeze_count() == 0
