"""Schedules as classes from a registry: what each answers (the contract of nebula.runtime.schedules.base),
the order of work each one names from a board (socket-free: arrivals played by hand), and what a job
file may and may not say about them. Whether each one trains right is tests/unit/test_runtime.py's
equivalence test, which covers every registered schedule."""
import pytest
import torch

from nebula.errors import ConfigError, StageError
from nebula.runtime.actions import Apply, Backward, BackwardInput, BackwardWeight, Forward, Open
from nebula.runtime.board import Board
from nebula.runtime.graph import LinkConfig
from nebula.runtime.job import parse_job
from nebula.runtime.schedules import (
    ExactWeights,
    ForwardOnly,
    OneStepStale,
    Pace,
    Schedule,
    Synchronous,
    WeightStash,
    build_schedule,
    register_schedule,
)
from nebula.runtime.train import TrainConfig


def test_a_name_is_registered_once():
    with pytest.raises(ConfigError, match="already registered by Synchronous"):
        register_schedule("synchronous")(type("Mine", (Synchronous,), {}))


@pytest.mark.parametrize("table, message", [
    ({"name": "eventually"}, r"\[schedule\].name: 'eventually' is not one of 'synchronous', '1f1b', "
                             r"'forward-only', 'gpipe', 'one-step-stale'"),
    ({"name": "1f1b", "in_flight": 0}, r"in_flight: 0 must be >= 1"),
    ({"name": "1f1b", "in_flight": "links"}, r"\[schedule\].in_flight: 'links' is none of int, Literal"),
    ({"name": "synchronous", "credit": 3}, r"\[schedule\].credit: only name = \"forward-only\" takes a credit; "
                                          r"under 'synchronous' a forward-only link's credit is 1"),
    ({"name": "forward-only", "credit": 0}, r"\[schedule\].credit: 0 must be >= 1"),
    ({"name": "forward-only", "creddit": 2}, r"unknown key 'creddit'.*did you mean 'credit'"),
])
def test_schedule_tables_are_checked(table, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(table, "job.toml: [schedule]")


def test_each_schedule_answers_its_contract():
    train = TrainConfig(steps=10, batch_size=4, micro_batches=2, checkpoint_every=3)
    sync, stale, paced = (build_schedule({"name": n}, "j") for n in ("synchronous", "one-step-stale", "forward-only"))
    assert (type(sync), type(stale), type(paced)) == (Synchronous, OneStepStale, ForwardOnly)
    assert [s.credit for s in (sync, stale, paced)] == [1, 2, 2]
    assert [s.horizon for s in (sync, stale, paced)] == [3, 4, 4]
    assert build_schedule({"name": "forward-only", "credit": 5}, "j").credit == 5
    assert sync.opens(4, True, train) == (5,) and paced.opens(4, False, train) == (5,)
    assert stale.opens(4, True, train) == (5, 6)  # the next step's forward before this update
    assert stale.opens(2, True, train) == (3,)  # never across a checkpoint (step 3)
    assert stale.opens(9, True, train) == (10,)  # nor past the end
    assert stale.opens(4, False, train) == (5,)  # a stage that waits for no gradient runs exact
    assert type(stale.weights(True, train)) is WeightStash and type(stale.weights(False, train)) is ExactWeights
    assert type(sync.weights(True, train)) is ExactWeights
    assert stale.default_headroom > sync.default_headroom  # one step stale, the wire hides under a whole step


def test_a_schedule_that_cannot_run_the_graph_is_refused_when_the_job_loads():
    raw = {"job": {"name": "t"}, "schedule": {"name": "forward-only"},
           "stages": {"src": {"address": "a/src/0", "impl": "example-source"},
                      "sink": {"address": "b/sink/0", "impl": "example-sink"}},
           "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True}]}
    with pytest.raises(ConfigError, match=r'src->sink: backward = true under \[schedule\] name = "forward-only"'):
        parse_job(raw)


def test_the_stash_keeps_the_weights_before_the_update_and_hands_their_gradients_over():
    """Step t runs at W_{t-2}: the copy is taken before the update that overwrites it, and the gradient
    computed at the copy is what the live weights are updated with."""
    weights = WeightStash(TrainConfig(steps=10, batch_size=4, micro_batches=2, checkpoint_every=5).saves_after)
    live = {"w": torch.nn.Parameter(torch.zeros(2))}
    assert weights.ready_for(1) and weights.ready_for(2) and not weights.ready_for(3)
    assert weights.for_step(1, live) is None  # right after a checkpoint (step 0): the live weights, W_0
    assert torch.equal(weights.for_step(2, live)["w"], torch.zeros(2))  # step 2 runs at W_0 before 1's update
    weights.before_update(1, live)
    live["w"].data += 1  # W_1
    weights.updated(1)
    weights.before_update(2, live)  # step 3's forward has not run yet: W_1 is kept before step 2 overwrites it
    live["w"].data += 1  # W_2
    weights.updated(2)
    assert torch.equal(weights.for_step(3, live)["w"], torch.ones(2))  # W_1, not the live W_2
    weights.stash[3]["w"].grad = torch.full((2,), 7.0)
    weights.before_update(3, live)
    assert torch.equal(live["w"].grad, torch.full((2,), 7.0))  # the stash's gradient updates the live weights
    assert not weights.stale(6)  # step 5 is a checkpoint: step 6 runs exact, at W_5
    with pytest.raises(StageError, match="no stashed weights for step 9"):
        weights.for_step(9, live)
    weights.reset(7)  # a restore: nothing runs ahead across it
    assert weights.for_step(8, live) is None


def test_pace_holds_a_sender_to_its_credit_and_names_who_lags():
    out = [LinkConfig("g", "d", ("ids",), False, ()), LinkConfig("g", "e", ("h",), True, ())]
    pace = Pace(2, [], out)
    assert pace.allows(2) and not pace.allows(3) and pace.lagging(3) == ["d"]  # the two-way link needs no PACE
    assert pace.acknowledged("g->d", 1) and pace.allows(3)
    assert not pace.acknowledged("g->e", 1)  # no PACE on a two-way link: the runner refuses it
    pace.reset(7)
    assert pace.allows(9) and not pace.allows(10)
    assert Pace(1, [LinkConfig("g", "d", ("ids",), False, ())], []).senders == ["g"]


def test_schedules_compare_by_name_and_options():
    assert build_schedule({"name": "forward-only", "credit": 3}, "j") == build_schedule(
        {"name": "forward-only", "credit": 3}, "j")
    assert build_schedule({"name": "forward-only"}, "j") != build_schedule({"name": "synchronous"}, "j")
    assert isinstance(build_schedule({}, "j"), Schedule) and build_schedule({}, "j").name == "synchronous"


# -- the order each schedule names, from a board -----------------------------------------------------------
def board_of(schedule: dict, stage: str, stages=3, micro_batches=4) -> tuple[Board, Schedule]:
    from tests.support.runtime import example_job
    job = example_job(stages=stages, micro_batches=micro_batches, schedule=schedule["name"],
                      schedule_options={k: v for k, v in schedule.items() if k != "name"})
    graph = job.graph
    board = Board(stage, graph, job.train, Pace(job.schedule.credit, graph.in_links[stage], graph.out_links[stage]),
                  ready_for=lambda t: t == board.applied + 1)
    return board, job.schedule


SHORT = {Forward: "F", Backward: "B", BackwardInput: "BI", BackwardWeight: "BW", Apply: "A"}


def play(schedule: dict, lag: int, stage="mid") -> tuple[list, int]:
    """Step 1 at `stage` of a 3-stage chain: every input has arrived; the gradient of micro-batch i comes
    back once the stage has forwarded i + lag (a downstream as slow as `lag` forwards). -> (the actions
    named, as short strings; the most micro-batches in flight)."""
    board, sched = board_of(schedule, stage)
    ids = torch.zeros(4, dtype=torch.int64)
    for m in range(4):
        board.arrived("src", "src->mid", 1, m, {}, ids, ahead=1)
    names, most = [], 0
    while (action := sched.next_action(board)) is not None:
        state = board.open.get(action.step)
        if isinstance(action, Forward):
            board.take_forward(state)
            back = state.forwarded - 1 - lag  # the gradient that this forward lets come back
            if back >= 0:
                board.gradients("mid->sink", 1, back, {"hidden": torch.zeros(1)})
        elif isinstance(action, (Backward, BackwardInput)):
            board.take_gradients(state, isinstance(action, Backward))
        elif isinstance(action, BackwardWeight):
            board.take_weight(state)
        elif isinstance(action, Apply):
            board.open.pop(1)
            board.applied = 1
        most = max(most, state.in_flight if state else 0)
        names.append(SHORT[type(action)] + str(getattr(action, "index", "")))
        if lag and state and state.forwarded == 4 and not board.can_backward(state) and state.backwarded < 4:
            for m in range(state.backwarded, 4):  # the rest comes back after the last forward
                if m not in state.grads:
                    board.gradients("mid->sink", 1, m, {"hidden": torch.zeros(1)})
    return names, most


def test_the_schedule_owns_the_order_of_work():
    """The same arrivals at the middle of a chain, three orders: `synchronous` backwards an input gradient as
    soon as it can and leaves weight gradients to the end; `gpipe` forwards the whole step first; `1f1b`
    never holds more micro-batches than its bound (weight gradients free them). Each sends an input gradient
    (BI) before computing its weight gradient (BW)."""
    assert play({"name": "synchronous"}, lag=0)[0] == [
        "F0", "BI0", "F1", "BI1", "F2", "BI2", "F3", "BI3", "BW0", "BW1", "BW2", "BW3", "A"]
    assert play({"name": "gpipe"}, lag=0)[0] == [
        "F0", "F1", "F2", "F3", "BI0", "BI1", "BI2", "BI3", "BW0", "BW1", "BW2", "BW3", "A"]
    order, most = play({"name": "1f1b", "in_flight": 2}, lag=1)
    assert order == ["F0", "F1", "BI0", "BW0", "F2", "BI1", "BW1", "F3", "BI2", "BI3", "BW2", "BW3", "A"]
    assert most == 2
    assert play({"name": "synchronous"}, lag=1)[1] == 4  # unbounded: all four held


def test_1f1b_counts_the_links_of_a_wan_pipeline():
    """In flight at each stage of a 3-stage chain: "stages" is torch's Schedule1F1B count (the stages from it
    to the last), "hops" adds each link once per direction (a WAN link holds micro-batches too)."""
    bounds = {count: [board_of({"name": "1f1b", "in_flight": count}, s)[1].in_flight(board_of(
        {"name": "1f1b", "in_flight": count}, s)[0]) for s in ("src", "mid", "sink")] for count in ("stages", "hops")}
    assert bounds == {"stages": [3, 2, 1], "hops": [7, 4, 1]}


def test_a_source_opens_its_steps_through_the_schedule():
    board, sched = board_of({"name": "one-step-stale"}, "src")
    board.target = 12
    assert sched.next_action(board) == Open(1)
    board.open_step(1, torch.arange(16), list(range(16)))
    assert sched.next_action(board) == Open(2)  # one step stale: the next step too (no checkpoint at 1)
    board.target = 1  # training to step 1 only (or an evaluation: 0): no step past it is opened
    assert sched.next_action(board) == Forward(1, 0)


def test_a_new_schedule_is_one_class():
    """A schedule of one's own is a class with `order(board)`, registered by name: here every forward of
    a step, then its backwards whole (input and weight gradients in one pass)."""
    @register_schedule("test-backward-last")
    class BackwardLast(Synchronous):
        def order(self, board):
            for state in board.steps():
                if board.can_forward(state):
                    return Forward(state.step, state.forwarded)
                if state.forwarded == len(board.items) and board.can_backward(state):
                    return Backward(state.step, state.backwarded)
            return None
    try:
        order, _ = play({"name": "test-backward-last"}, lag=0)
        assert order == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3", "A"]
    finally:
        from nebula.runtime.schedules import base
        base._SCHEDULES.pop("test-backward-last")
