"""ABNet-Cloud es->en across two sites as real processes (two gateways, two stages, CURVE, loopback), on the
tiny job (tests/e2e/jobs/tiny.toml) with ABNet's own objective (CMLM, mask-predict; the demo's autoregressive
one: test_demo_report.py): the real models train on every scheduled example once, BLEU is scored at the
decoder's site where the references stay, and the trained job translates new sentences across the sites
(`nebula translate`). What the framework does with a job (restarts, resumes, checkpoints, audit, hot start)
is tested on the example workload: test_two_sites.py."""
import json
import subprocess
import sys

from tests.support.sites import E2E, JOB_TIMEOUT, expected_ledger, records, write_job


def test_the_job_trains_scores_bleu_where_the_references_are_and_translates_across_the_sites(tmp_path, start_job):
    job_file = write_job(tmp_path, {'objective = "ar"': 'objective = "cmlm"'})
    sites = start_job(job_file)
    sites.wait()
    sites.stop()

    for name in sites.stages:
        assert sites.ledger(name) == expected_ledger(sites.job), f"{name} trained on other examples than scheduled"
    scores = json.loads((sites.run / "encoder" / "scores.json").read_text())
    assert scores["split"] == "test" and scores["n"] == 16
    assert isinstance(scores["bleu"], float) and 0.0 <= scores["bleu"] <= 100.0
    hyps = (sites.run / "decoder" / "test.hyp").read_text().splitlines()  # kept at site b, with the refs
    refs = (sites.run / "decoder" / "test.ref").read_text().splitlines()
    assert len(hyps) == len(refs) == 16 and scores["samples"][0] == hyps[0]  # references stay at b
    assert not (sites.run / "encoder" / "test.ref").exists()

    def arrived_at_b() -> int:
        return sum(1 for r in records(sites.run / "audit" / "b.jsonl")
                   if r.get("event") == "transfer.in" and r.get("kind") == "TENSORS")
    before = arrived_at_b()
    sources = (E2E / "data" / "es-en" / "test.src").read_text().splitlines()[:3]
    (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
    done = subprocess.run([sys.executable, "-m", "nebula.cli", "translate", "--run-dir", str(sites.run),
                           "--job", str(job_file), "--input", str(tmp_path / "in.txt")],
                          capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == len(sources)  # one translation per sentence, in order
    assert arrived_at_b() > before  # the source encodings crossed to site b through its gateway
