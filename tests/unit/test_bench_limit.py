"""The limit a pipeline row is read against (nebula_lab.bench.limit): GPipe's (m + S - 1) x t for uniform
compute-only stages, the busiest link direction plus one micro-batch's round trip on a wire-bound chain,
and no fill for a schedule that does not drain."""
import pytest

from nebula.runtime.schedules import schedule_names
from nebula_lab.bench.limit import limit
from nebula_lab.bench.wan import SCHEDULES
from tests.support.runtime import example_job


def chain(stages: int):
    return example_job(stages=stages).graph


def test_uniform_compute_only_stages_give_gpipes_bubble():
    graph, m, t = chain(3), 8, 0.5  # t: one micro-batch's forward and backward at a stage
    found = limit(graph, {s: m * t for s in graph.stages}, {}, m, 0.0, drains=True)
    assert found["limit_s"] == pytest.approx((m + 3 - 1) * t)
    assert limit(graph, {s: m * t for s in graph.stages}, {}, m, 0.0, drains=False)["limit_s"] == pytest.approx(m * t)


def test_a_wire_bound_chain_is_its_busiest_link_direction_plus_one_round_trip():
    graph, m = chain(3), 4
    compute = {"src": 0.4, "mid": 0.4, "sink": 0.8}
    wire = {(link.name, d): 2.0 for link in graph.links for d in ("forward", "backward")}
    wire[("mid->sink", "backward")] = 3.0
    found = limit(graph, compute, wire, m, rtt_s=0.1, drains=True)
    trip = (0.4 + 0.4 + 0.8) / m + (2.0 * 3 + 3.0) / m + 2 * 0.1  # stages, link directions, RTT per link
    assert found["busiest"] == "mid->sink backward"
    assert found["limit_s"] == pytest.approx(3.0 + trip - 3.0 / m)


def test_the_bench_names_every_registered_schedule():
    """`nebula bench wan --schedule` lists them without importing torch: the two lists must agree."""
    assert set(SCHEDULES) == set(schedule_names())
