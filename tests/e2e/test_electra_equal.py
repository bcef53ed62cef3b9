"""Cross-site ELECTRA-Cloud equals one-site training bit for bit (paper §4.3: the inter-cloud run "won't
affect the convergence"; here it cannot, by construction).

The tiny job without dropout and with one thread per process: trained in one process on one site
(in-process channels), and across two sites (a gateway each, CURVE, a process per stage, ids deflated on
the wire). Every step's loss of G and of D, and D's L_D and L_CLM, must be the same floats, and both
ledgers the example order's: a micro-batch dropped, applied twice or reordered would change D's weights
from that step on, and with them every later loss.

With the forward-only schedule this holds for any credit, not only in lock step: no gradient and no
information flows from D back to G, so the credit changes when G computes a step, never what it computes,
and D trains on each step's micro-batches in the runtime's canonical order, whenever they arrive.
"""
import pytest

from nebula.runtime.job import load_job
from nebula.runtime.onesite import run_one_site
from tests.support.electra import electra_job, expected_ledger, ledger
from tests.support.sites import records

DETERMINISTIC = {"steps = 8": "steps = 6", "micro_batches = 2": "micro_batches = 4",
                 "ffn = 64}": "ffn = 64, dropout = 0.0}"}
ONE_SITE = {'address = "b/disc/0"': 'address = "a/disc/0"'}
SCHEDULES = {"synchronous": {'name = "forward-only"\ncredit = 2': 'name = "synchronous"'},
             "forward-only, credit 2": {}}


def losses(run) -> dict[str, list]:
    """Per stage, each step's (step, loss) and, at D, its summed L_D and L_CLM."""
    out = {}
    for stage in ("generator", "disc"):
        out[stage] = [(r["step"], r["loss"], r.get("stats", {}).get("rtd_loss"), r.get("stats", {}).get("clm_loss"))
                      for r in records(run / stage / "metrics.jsonl", "step")]
    return out


# forward-only equals one process in tests/unit/test_runtime.py and crosses sites in the ELECTRA demo's test: slow here
@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.slow) if s.startswith("forward-only") else s
                                      for s in SCHEDULES])
def test_two_sites_train_exactly_what_one_site_trains(schedule, tmp_path, start_job):
    changes = {**DETERMINISTIC, **SCHEDULES[schedule]}
    one = load_job(electra_job(tmp_path / "one", {**changes, **ONE_SITE}))
    run_one_site(one, tmp_path / "one" / "run", quiet=True, timeout=300)
    sites = start_job(electra_job(tmp_path / "two", changes))
    sites.wait()

    expected = losses(tmp_path / "one" / "run")
    assert [s for s, *_ in expected["disc"]] == list(range(1, 7))
    assert all(r[2] is not None and r[3] is not None for r in expected["disc"])  # D recorded L_D and L_CLM
    assert losses(sites.run) == expected  # every float the same, step by step
    for stage in ("generator", "disc"):
        assert ledger(sites.run / stage) == ledger(tmp_path / "one" / "run" / stage) \
            == expected_ledger(sites.job, ["generator"])
