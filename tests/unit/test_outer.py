"""The outer optimiser and the exchange's decisions, without sockets (nebula.runtime.outer, exchange):
Nesterov SGD as torch's, fragments, who is averaged, who is refused, and what a replica keeps when it
takes another's state."""
import pytest
import torch

from nebula.runtime.exchange import Exchange, Pending
from nebula.runtime.outer import OuterOptimizer, OuterState, average, flatten, split_fragments, write_back
from nebula.runtime.replica_set import OuterConfig


def test_the_outer_step_is_torchs_sgd_with_nesterov_momentum():
    torch.manual_seed(0)
    anchor = torch.randn(50)
    ours, theirs = OuterState(anchor.clone()), anchor.clone().requires_grad_()
    sgd = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterOptimizer(OuterConfig(lr=0.7, momentum=0.9))
    for _ in range(4):
        g = torch.randn(50)
        outer.step(ours, g, [0, 1])
        theirs.grad = g.clone()
        sgd.step()
        torch.testing.assert_close(ours.anchor, theirs.detach(), rtol=0, atol=1e-6)
    assert ours.version == 4 and ours.weight == 8


def test_lr_one_without_momentum_is_the_replicas_mean():
    anchor = torch.zeros(3)
    replicas = {0: torch.tensor([1.0, 2.0, 3.0]), 1: torch.tensor([3.0, 2.0, 1.0]), 2: torch.tensor([2.0, 2.0, 2.0])}
    state = OuterState(anchor.clone())
    OuterOptimizer(OuterConfig(name="sgd", lr=1.0, momentum=0.0)).step(
        state, average({j: anchor - w for j, w in replicas.items()}), sorted(replicas))
    torch.testing.assert_close(state.anchor, torch.tensor([2.0, 2.0, 2.0]))


def test_fragments_are_contiguous_balanced_and_never_empty():
    sizes = {f"p{i}": n for i, n in enumerate([100, 1, 1, 100, 50, 50, 1])}
    for count in (1, 2, 3, 7, 9):
        parts = split_fragments(sizes, count)
        assert [n for part in parts for n in part] == list(sizes)  # every parameter once, in order
        assert len(parts) == min(count, len(sizes)) and all(parts)
    two = split_fragments(sizes, 2)
    assert abs(sum(sizes[n] for n in two[0]) - sum(sizes[n] for n in two[1])) < max(sizes.values())


def test_flatten_and_write_back_round_trip():
    params = {"a": torch.randn(2, 3), "b": torch.randn(4)}
    flat = flatten(params, ["a", "b"])
    assert flat.shape == (10,)
    write_back(params, ["b", "a"], torch.arange(10, dtype=torch.float32))
    assert params["b"].tolist() == [0, 1, 2, 3] and params["a"].flatten().tolist() == list(range(4, 10))


def exchange(peers=(1, 2), size=4):
    params = {"w": torch.zeros(size)}
    return Exchange.of(0, {j: f"x{j}/s/0" for j in peers}, params, [["w"]], OuterOptimizer(OuterConfig())), params


def test_a_round_averages_what_arrived_and_marks_the_missing_absent_until_they_speak():
    ex, params = exchange()
    ex.pending[0] = Pending(0, 4, 0.0, torch.ones(4))
    assert ex.offer(1, 0, 0, ex.states[0].chain, 0, torch.full((4,), 3.0)) == "kept"
    assert ex.awaited(0) == [2]
    decision = ex.decide(0, params)
    assert decision.contributors == [0, 1] and decision.missing == [2] and decision.version == 1
    assert ex.present() == [1] and ex.absent() == [2]
    ex.heard(2)
    assert ex.present() == [1, 2]


def test_a_late_second_or_foreign_pseudo_gradient_is_never_averaged():
    ex, params = exchange()
    chain = ex.states[0].chain
    assert ex.check(7, 0, {"delta": torch.zeros(4)}, "delta").startswith("replica 7 is not")
    assert "shape" in ex.check(1, 0, {"delta": torch.zeros(5)}, "delta")
    assert "non-finite" in ex.check(1, 0, {"delta": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, "delta")
    assert "fragment 3" in ex.check(1, 3, {"delta": torch.zeros(4)}, "delta")
    assert ex.offer(1, 0, 0, chain, 0, torch.ones(4)) == "kept"
    assert ex.offer(1, 0, 0, chain, 0, torch.full((4,), 100.0)) == "twice"
    ex.pending[0] = Pending(0, 4, 0.0, torch.ones(4))
    ex.decide(0, params)
    assert ex.offer(2, 0, 0, chain, 0, torch.full((4,), 100.0)) == "stale"  # a round we have passed
    assert ex.awaited(0) == [1, 2]  # 2 spoke since it missed round 0 (late): round 1 awaits it again
    # g = mean(1, 1) = 1, Nesterov: -0.7 x (g + 0.9 g); the 100s of the second and the late copy are nowhere
    torch.testing.assert_close(ex.states[0].anchor, torch.full((4,), -0.7 * 1.9))


def test_a_replica_ahead_or_on_a_better_history_is_fetched_and_what_was_sent_counts_once():
    ex, params = exchange()
    assert ex.offer(2, 0, 1, "f" * 16, 3, torch.zeros(4)) == "ahead"  # it finished round 0 already
    assert ex.behind == {0: 2}
    params["w"].copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))  # our weights at our send
    ex.pending[0] = Pending(0, 4, 0.0, torch.zeros(4), sent=flatten(params, ["w"]))
    params["w"].add_(0.5)  # progress after the send (overlap): never sent, kept
    theirs = OuterState(torch.full((4,), 10.0), torch.zeros(4), 1, "f" * 16, 3)
    ex.adopt(0, theirs, params)
    torch.testing.assert_close(params["w"], torch.full((4,), 10.5))
    assert ex.states[0].version == 1 and not ex.pending and not ex.behind


def test_equal_histories_do_not_fetch_and_a_worse_one_is_refused():
    ex, _ = exchange()
    state = ex.states[0]
    assert not ex.compare(1, 0, state.version, state.chain, state.weight)
    state.version, state.weight = 2, 4
    assert ex.offer(1, 0, 2, "a" * 16, 3, torch.zeros(4)) == "stale"  # fewer contributions: ours wins
    assert (0, 2, 1) in ex.refused and 1 not in ex.awaited(0)


@pytest.mark.parametrize("names,count", [(["a"], 1), (["a", "b", "c"], 2)])
def test_a_restart_before_a_send_keeps_nothing_of_it_when_it_takes_anothers_state(names, count):
    params = {n: torch.ones(2) for n in names}
    ex = Exchange.of(1, {0: "a/s/0"}, params, split_fragments({n: 2 for n in names}, count),
                     OuterOptimizer(OuterConfig()))
    ex.sent_before = {f: flatten(params, ex.fragments[f]) for f in range(len(ex.fragments))}
    for f in range(len(ex.fragments)):
        ex.adopt(f, OuterState(torch.full((2 * len(ex.fragments[f]),), 5.0), None, 2, "b" * 16, 4), params)
    assert all(p.tolist() == [5.0, 5.0] for p in params.values()) and ex.settled == set(range(len(ex.fragments)))


def test_a_sharded_round_applies_each_slices_mean_and_leaves_a_slice_none_reached_untouched():
    """Three replicas, 4 weights in slices [0, 2), [2, 3), [3, 4): replica 0 averages its slice over the parts
    that arrived, takes replica 1's mean of slice 1, and replica 2 (owner of slice 2) is silent: slice 2 keeps
    its anchor, momentum and live weight, and the chain says which slices whom."""
    ex, params = exchange()
    ex.slices = [[(0, 2), (2, 3), (3, 4)]]
    assert ex.owners() == [0, 1, 2]
    chain = ex.states[0].chain
    before = flatten(params, ["w"]).clone()
    ex.pending[0] = Pending(0, 4, 0.0, torch.tensor([1.0, 1.0, 1.0, 1.0]), owners=ex.owners())
    assert ex.offer(1, 0, 0, chain, 0, torch.tensor([3.0, 5.0]), ("part", 0)) == "kept"
    assert ex.awaited_parts(0) == [2]  # replica 2's part of slice 0 has not come
    means = ex.mean_of(0)
    assert list(means) == [0] and means[0][1] == [0, 1]
    torch.testing.assert_close(means[0][0], torch.tensor([2.0, 3.0]))
    ex.pending[0].means, ex.pending[0].posted = means, True
    assert ex.offer(1, 0, 0, chain, 0, (torch.tensor([7.0]), [0, 1, 2]), ("mean", 1)) == "kept"
    assert ex.awaited_means(0) == [2]
    ex.states[0].momentum = torch.ones(4)  # earlier rounds' momentum: a slice none reached must not take it
    decision = ex.decide_sharded(0, params)
    assert decision.contributors == [0, 1, 2] and decision.missing == [2] and ex.absent() == [2]
    # Nesterov (lr 0.7, momentum 0.9: m = 0.9 m + g, anchor -= 0.7 (g + 0.9 m)) on the reached slices only
    g, m = torch.tensor([2.0, 3.0, 7.0]), 0.9 + torch.tensor([2.0, 3.0, 7.0])
    torch.testing.assert_close(ex.states[0].anchor[:3], before[:3] - 0.7 * (g + 0.9 * m))
    torch.testing.assert_close(ex.states[0].momentum, torch.cat([m, torch.ones(1)]))
    assert float(ex.states[0].anchor[3]) == float(before[3])
    assert float(flatten(params, ["w"])[3]) == float(before[3])  # its live weight too
    assert ex.states[0].weight == 2 + 3 + 0 and ex.owners() == [0, 1, 0]  # the next round: slice 2 is ours
