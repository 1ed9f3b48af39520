"""The schedule library and `validate`: placements, orders written down from their papers, and one test per
kind of error a user can make, each checking that the message names the problem and shows the table with
the offending task in brackets."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest

import mpmd
from mpmd.schedules import BUILTINS, Custom, Schedule, Task, backward, format_table, one_f_one_b, validate

GRID = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 5, 8, 9, 12)]


def builtins(p: int) -> list[Schedule]:
    """Every built-in on p actors (interleaved ones with 2 and 3 stages per actor)."""
    return [mpmd.GPipe(p), mpmd.OneFOneB(p), mpmd.EagerOneFOneB(p), mpmd.ZeroBubbleH1(p),
            mpmd.InterleavedOneFOneB(2 * p, p), mpmd.InterleavedOneFOneB(3 * p, p),
            mpmd.InterleavedZeroBubble(2 * p, p), mpmd.InterleavedZeroBubble(3 * p, p), mpmd.ZeroBubbleV(p), mpmd.DualPipeV(p)]


def rows(*lines: str) -> list[list[Task]]:
    return [[Task.parse(t) for t in line.split()] for line in lines]


# ---------------------------------------------------------------- the built-ins


def test_every_builtin_is_exported_from_mpmd_and_listed_for_the_command_line():
    assert set(BUILTINS) == {"GPipe", "OneFOneB", "EagerOneFOneB", "InterleavedOneFOneB", "ZeroBubbleH1", "InterleavedZeroBubble",
                             "ZeroBubbleV", "DualPipeV"}
    for name, cls in BUILTINS.items():
        assert getattr(mpmd, name) is cls


@pytest.mark.parametrize("p, m", GRID)
def test_every_builtin_is_complete_and_deadlock_free(p, m):
    for s in builtins(p):
        if m < s.min_microbatches:
            continue
        table = validate(s, m)
        per_stage = 3 if s.split_backward else 2
        assert sum(map(len, table)) == per_stage * s.num_stages * m, s
        assert all(t.kind in ("F", "I", "W") if s.split_backward else t.kind in ("F", "B") for row in table for t in row)


def test_placements_one_stage_per_actor_circular_and_v():
    assert [mpmd.OneFOneB(4).actor_of(s) for s in range(4)] == [0, 1, 2, 3]
    il = mpmd.InterleavedOneFOneB(num_stages=8, num_actors=4)
    assert (il.num_actors, il.per_actor) == (4, 2)
    assert [il.actor_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert il.stages_of(1) == [1, 5]
    for cls in (mpmd.ZeroBubbleV, mpmd.DualPipeV):
        v = cls(num_actors=4)
        assert (v.num_stages, v.num_actors) == (8, 4)
        assert [v.stages_of(a) for a in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_split_backward_says_whether_the_table_uses_i_and_w():
    assert [s.split_backward for s in builtins(2)] == [False, False, False, True, False, False, True, True, True, True]
    assert Custom(num_stages=1, order=(("0F0", "0I0", "0W0"),)).split_backward
    assert not Custom(num_stages=1, order=(("0F0", "0B0"),)).split_backward


def test_gpipe_and_1f1b_keep_their_textbook_orders():
    # GPipe: all forwards, then all backwards. 1F1B: p-1-s warm-up forwards, then F and B in turn, then Bs.
    assert mpmd.GPipe(2).tasks(3) == rows("0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2")
    assert mpmd.OneFOneB(3).tasks(4) == rows("0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
                                             "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
                                             "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3")


def test_eager_1f1b_runs_twice_the_warm_up_forwards():
    # JaxPP's Eager1F1B: actor a runs 2(p-a)-1 forwards before its first backward (1F1B: p-a), then alternates.
    p, m = 4, 10
    for a, row in enumerate(mpmd.EagerOneFOneB(p).tasks(m)):
        first_b = next(i for i, t in enumerate(row) if t.kind == "B")
        assert first_b == 2 * (p - a) - 1
        tail = [t.kind for t in row[first_b : first_b + 2 * (m - first_b)]]
        assert tail == ["B", "F"] * (m - first_b)


def test_interleaved_follows_megatrons_warm_up_and_microbatch_groups():
    # Narayanan et al. 2021: actor a warms up with (v-1)*p + 2*(p-1-a) forwards; microbatches go through the
    # actor's stages in groups of p: stage a for mbs 0..p-1, then stage a+p for mbs 0..p-1, then mbs p..2p-1.
    p, v, m = 4, 2, 8
    for a, row in enumerate(mpmd.InterleavedOneFOneB(v * p, p).tasks(m)):
        fwd = [t for t in row if t.kind == "F"]
        assert fwd[:8] == [Task(a, "F", i) for i in range(4)] + [Task(a + 4, "F", i) for i in range(4)]
        assert row.index(next(t for t in row if t.kind == "B")) == (v - 1) * p + 2 * (p - 1 - a) + 1
        assert [t for t in row if t.kind == "B"][:4] == [Task(a + 4, "B", i) for i in range(4)]  # last stage first


def test_dualpipev_pairs_a_forward_with_the_other_stages_backward_in_its_main_phase():
    # DeepSeek's DualPipeV main step "F0B1 F1B0": forward of one stage, then a whole backward (I W) of the other.
    p, m = 4, 12
    s = mpmd.DualPipeV(p)
    for a, row in enumerate(s.tasks(m)):
        first, last = s.stages_of(a)
        pairs = [(row[i], row[i + 1], row[i + 2]) for i in range(len(row) - 2)]
        fb = [x for x in pairs if x[0].kind == "F" and (x[1].kind, x[2].kind) == ("I", "W") and x[0].stage != x[1].stage
              and x[1].stage == x[2].stage and x[1].mb == x[2].mb]
        assert len(fb) >= 2 * (m - 2 * p + a + 1), (a, format_table([row]))
        assert {x[0].stage for x in fb} == {first, last}


def test_custom_takes_split_backwards_and_any_stage_to_actor_map():
    # A hand-written V: stages 0 and 3 on actor 0, 1 and 2 on actor 1.
    v = Custom(num_stages=4, stage_actor=(0, 1, 1, 0), order=(
        ("0F0", "0F1", "3F0", "3I0", "3W0", "3F1", "3I1", "0I0", "3W1", "0I1", "0W0", "0W1"),
        ("1F0", "2F0", "1F1", "2F1", "2I0", "1I0", "2I1", "1I1", "2W0", "1W0", "2W1", "1W1")))
    assert validate(v, 2) == [list(r) for r in v.order]
    assert v.stages_of(0) == [0, 3] and v.num_actors == 2


def test_a_subclass_is_the_other_way_to_write_a_schedule():
    @dataclass(frozen=True)
    class LateOneFOneB(Schedule):
        """1F1B with one extra warm-up forward per actor."""

        def tasks(self, m):
            return [one_f_one_b([Task(s, "F", i) for i in range(m)], [backward(s, i, False) for i in range(m)], min(self.num_stages - s, m))
                    for s in range(self.num_stages)]

    table = validate(LateOneFOneB(3), 5)
    assert [row.index(Task(s, "B", 0)) for s, row in enumerate(table)] == [4, 3, 2]


def test_schedules_are_hashable_values():
    # The schedule is a parameter of the traced loop primitive: equal schedules must compare and hash equal.
    assert mpmd.InterleavedOneFOneB(8, 4) == mpmd.InterleavedOneFOneB(8, 4)
    assert len({mpmd.ZeroBubbleV(4), mpmd.ZeroBubbleV(4), mpmd.DualPipeV(4), Custom(num_stages=1, order=(("0F0", "0B0"),))}) == 3
    assert repr(mpmd.DualPipeV(4)) == "DualPipeV(num_actors=4)"


@pytest.mark.parametrize("cls", [mpmd.DualPipeV, mpmd.ZeroBubbleV])
def test_a_v_schedule_takes_num_stages_as_every_other_schedule_does_and_says_what_is_wrong(cls):
    assert cls(num_stages=4) == cls(num_actors=2) == cls(2, num_stages=4) and cls(num_stages=4).num_stages == 4
    with pytest.raises(mpmd.ScheduleError, match=rf"{cls.__name__} places 2 stages on each actor .* must be even; got 5"):
        cls(num_stages=5)
    with pytest.raises(mpmd.ScheduleError, match="must be 2 \\* num_actors"):
        cls(num_actors=2, num_stages=6)
    with pytest.raises(mpmd.ScheduleError, match=rf"{cls.__name__} needs num_actors"):
        cls()


# ---------------------------------------------------------------- errors, one per kind


def check_marked(err: pytest.ExceptionInfo, *marked: str) -> None:
    text = str(err.value)
    assert re.search(r"^actor 0: ", text, re.M), text  # the table is printed
    for cell in marked:
        assert f"[{cell}]" in text, text


def test_deadlock_marks_where_every_actor_is_stuck():
    bad = Custom(num_stages=2, order=(("0F0", "0B0", "0F1", "0B1"), ("1F0", "1F1", "1B0", "1B1")))
    with pytest.raises(mpmd.ScheduleError, match="deadlocks") as err:
        validate(bad, 2)
    check_marked(err, "0B0", "1F1")
    assert "0B0 waits for 1B0 on actor 1" in str(err.value) and "1F1 waits for 0F1 on actor 0" in str(err.value)


def test_a_task_before_its_own_input_on_the_same_actor():
    bad = Custom(num_stages=2, order=(("0F0", "0F1", "0B0", "0B1"), ("1F0", "1B1", "1F1", "1B0")))
    with pytest.raises(mpmd.ScheduleError, match="1B1 on actor 1 comes before 1F1, which it needs") as err:
        validate(bad, 2)
    check_marked(err, "1B1")


def test_a_missing_task():
    with pytest.raises(mpmd.ScheduleError, match="missing from the schedule: 1B0") as err:
        validate(Custom(num_stages=2, order=(("0F0", "0B0"), ("1F0",))), 1)
    assert "actor 1: 1F0" in str(err.value)


def test_a_repeated_task():
    with pytest.raises(mpmd.ScheduleError, match="0F0 appears twice") as err:
        validate(Custom(num_stages=2, order=(("0F0", "0B0", "0F0"), ("1F0", "1B0"))), 1)
    check_marked(err, "0F0")


def test_a_stage_on_an_actor_that_does_not_exist():
    bad = Custom(num_stages=2, order=(("0F0", "0B0"), ("1F0", "1B0")), stage_actor=(0, 2))
    with pytest.raises(mpmd.ScheduleError, match=r"places stage 1 on actor 2, but its actors are 0\.\.1"):
        validate(bad, 1)


def test_a_stage_on_two_actors():
    """The task marked is the one off the stage's actor (actor_of), whichever comes first (the later one was marked,
    the correctly placed 1B0 here: a probe)."""
    with pytest.raises(mpmd.ScheduleError, match="stage 1 has tasks on two actors") as err:
        validate(Custom(num_stages=2, order=(("0F0", "0B0", "1F0"), ("1B0",))), 1)
    check_marked(err, "1F0")
    with pytest.raises(mpmd.ScheduleError, match="stage 1 has tasks on two actors") as err:
        validate(Custom(num_stages=2, order=(("0F0", "1F1", "0B0"), ("1F0", "1B0", "1B1"))), 2)
    check_marked(err, "1F1")


def test_a_task_on_the_wrong_actor():
    with pytest.raises(mpmd.ScheduleError, match="0F0 is on actor 1 but stage 0 belongs to actor 0") as err:
        validate(Custom(num_stages=2, order=(("1F0", "1B0"), ("0F0", "0B0"))), 1)
    check_marked(err, "0F0")


def test_w_before_its_i():
    with pytest.raises(mpmd.ScheduleError, match="0W0 on actor 0 comes before its 0I0.*a W needs its I") as err:
        validate(Custom(num_stages=2, order=(("0F0", "0W0", "0I0"), ("1F0", "1I0", "1W0"))), 1)
    check_marked(err, "0W0")


def test_i_without_w():
    with pytest.raises(mpmd.ScheduleError, match="0I0 has no 0W0") as err:
        validate(Custom(num_stages=2, order=(("0F0", "0I0"), ("1F0", "1I0", "1W0"))), 1)
    check_marked(err, "0I0")


def test_b_mixed_with_i_and_w_for_one_stage():
    with pytest.raises(mpmd.ScheduleError, match="stage 0 mixes a fused backward") as err:
        validate(Custom(num_stages=2, order=(("0F0", "0I0", "0W0", "0F1", "0B1"), ("1F0", "1B0", "1F1", "1B1"))), 2)
    check_marked(err, "0B1")


def test_too_few_microbatches_says_how_many_are_needed():
    with pytest.raises(mpmd.ScheduleError, match=r"DualPipeV\(num_actors=4\) needs at least 8 microbatches, got 7"):
        validate(mpmd.DualPipeV(4), 7)
    with pytest.raises(mpmd.ScheduleError, match="is a table for 2 microbatches.*3 were asked for") as err:
        validate(Custom(num_stages=1, order=(("0F0", "0F1", "0B0", "0B1"),)), 3)
    assert "actor 0: 0F0 0F1 0B0 0B1" in str(err.value)
    with pytest.raises(mpmd.ScheduleError, match="is a table for 2 microbatches.*1 were asked for; use 2 microbatches") as err:
        validate(Custom(num_stages=1, order=(("0F0", "0F1", "0B0", "0B1"),)), 1)  # (not "at least 2": 3 fail too)


def test_stages_not_divisible_by_actors():
    for cls in (mpmd.InterleavedOneFOneB, mpmd.InterleavedZeroBubble):
        with pytest.raises(mpmd.ScheduleError, match="num_stages=6 is not a multiple of num_actors=4.*num_stages=4 or 8"):
            cls(num_stages=6, num_actors=4)
    with pytest.raises(mpmd.ScheduleError, match="needs num_actors="):
        mpmd.InterleavedOneFOneB(8)
    for cls in (mpmd.InterleavedOneFOneB, mpmd.InterleavedZeroBubble):  # (0 said "needs num_actors=": taken for not given)
        with pytest.raises(mpmd.ScheduleError, match=rf"{cls.__name__}: num_actors must be a positive int, got 0"):
            cls(8, 0)


def test_a_table_too_big_to_build_is_refused_before_it_is_built():
    """`mpmd simulate --microbatches 100000000` grew to gigabytes for minutes (found by a probe)."""
    with pytest.raises(mpmd.ScheduleError, match="100000000 x 2 stages is more than a schedule table holds"):
        mpmd.simulate(mpmd.GPipe(2), 100_000_000)
    assert mpmd.simulate(mpmd.GPipe(2), 2000).step_time == 3 * 2001  # (unit costs: m + p - 1 F and B slots)


def test_a_task_outside_the_stages_or_microbatches():
    with pytest.raises(mpmd.ScheduleError, match="2F0 on actor 1 is not a task of 2 stages x 1 microbatches") as err:
        validate(Custom(num_stages=2, order=(("0F0", "0B0"), ("1F0", "1B0", "2F0"))), 1)
    check_marked(err, "2F0")


def test_a_subclass_with_the_wrong_number_of_task_lists():
    @dataclass(frozen=True)
    class OneList(Schedule):
        def tasks(self, m):
            return [[Task(s, k, i) for s in range(self.num_stages) for k in "FB" for i in range(m)]]

    with pytest.raises(mpmd.ScheduleError, match="gives 1 task lists for its 2 actors"):
        validate(OneList(2), 1)


def test_a_subclass_must_say_whether_it_splits_backwards():
    @dataclass(frozen=True)
    class Mislabelled(Schedule):
        @property
        def split_backward(self):
            return False

        def tasks(self, m):
            return [[Task(0, "F", i) for i in range(m)] + [Task(0, k, i) for i in range(m) for k in "IW"]]

    with pytest.raises(mpmd.ScheduleError, match="split_backward is False but its table uses I/W tasks") as err:
        validate(Mislabelled(1), 2)
    assert "actor 0: 0F0 0F1 0I0" in str(err.value)


def test_bad_arguments_name_what_was_passed():
    with pytest.raises(mpmd.ScheduleError, match="num_stages must be a positive int, got 0"):
        mpmd.OneFOneB(0)
    with pytest.raises(mpmd.ScheduleError, match="num_actors must be a positive int, got -1"):
        mpmd.ZeroBubbleV(num_actors=-1)
    with pytest.raises(mpmd.ScheduleError, match="number of microbatches must be a positive int, got 0"):
        validate(mpmd.GPipe(2), 0)
    with pytest.raises(mpmd.ScheduleError, match=r"order\[0\]\[1\] \(actor 0's task 1\): '0X1' is not a task"):
        Custom(num_stages=1, order=(("0F0", "0X1"),))  # (a ValueError naming no position before)

    @dataclass(frozen=True)
    class Strings(mpmd.Schedule):
        def tasks(self, m):
            return [[f"0{k}{i}" for k in "FB" for i in range(m)]]

    with pytest.raises(mpmd.ScheduleError, match=r"must give Task objects, but actor 0's task 0 is a str '0F0' \(mpmd.Task.parse"):
        validate(Strings(1), 1)


def test_a_schedules_repr_names_its_non_default_balance_and_remat():
    """A schedule prints as the constructor call that makes it: options left at their defaults are not shown,
    a balance or remat given is (the tune table and error messages print schedules by repr)."""
    assert repr(mpmd.OneFOneB(2)) == "OneFOneB(num_stages=2)"
    assert repr(mpmd.OneFOneB(4, balance="auto", remat=[2, 1])) == "OneFOneB(num_stages=4, balance='auto', remat=(1, 2))"
    assert repr(mpmd.InterleavedOneFOneB(4, 2, balance=(1, 1, 2, 2))) == "InterleavedOneFOneB(num_stages=4, num_actors=2, balance=(1, 1, 2, 2))"
    assert repr(mpmd.DualPipeV(2, remat=(0,))) == "DualPipeV(num_actors=2, remat=(0,))"
    costs = mpmd.SegmentCosts(F=(1.0, 2.0, 3.0), B=(2.0, 4.0, 6.0))
    assert repr(mpmd.GPipe(2, balance=costs)) == "GPipe(num_stages=2, balance=<costs of 3 segments>)"
    for s in (mpmd.OneFOneB(4, balance="even", remat=(3,)), mpmd.ZeroBubbleH1(3, balance=(2, 1, 1))):
        assert eval(repr(s), vars(mpmd)) == s


@pytest.mark.parametrize("make", [lambda f: mpmd.OneFOneB(2, fuse=f), lambda f: mpmd.DualPipeV(2, fuse=f),
                                  lambda f: mpmd.InterleavedOneFOneB(4, 2, fuse=f),
                                  lambda f: mpmd.Custom(num_stages=1, order=(("0F0", "0B0"),), fuse=f)])
def test_fuse_is_a_keyword_of_every_schedule_shown_when_off_and_kept_by_replace(make):
    """`fuse` (default True) says whether the compiler may merge an actor's consecutive tasks into one Run: the
    compiler reads `fuse_runs`; off, it shows in the repr (tune's table names the two variants apart)."""
    from dataclasses import replace

    on, off = make(True), make(False)
    assert on.fuse_runs is True and off.fuse_runs is False
    assert "fuse" not in repr(on) and repr(off).endswith(", fuse=False)") and on != off
    assert replace(on, fuse=False) == off and replace(off, balance=None).fuse is False
    assert make(np.bool_(False)).fuse is False  # (a numpy bool taken as the bool it is)
    for bad in ("no", 0, None):
        with pytest.raises(mpmd.ScheduleError, match=r"fuse must be True or False .*got (str 'no'|int 0|NoneType None)"):
            make(bad)
