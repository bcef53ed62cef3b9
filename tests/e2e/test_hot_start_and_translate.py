"""Training on one site hot-starts the two-site job (paper §4.3), and a trained two-site job
translates new sentences across the sites (`nebula translate`)."""
import dataclasses
import json
import shutil
import subprocess
import sys

from nebula.runtime.job import load_job
from nebula.runtime.onesite import run_one_site
from tests.support.sites import E2E, JOB_TIMEOUT, expected_ledger, records, write_job


def test_one_site_checkpoints_hot_start_the_two_site_job(tmp_path, start_job):
    job_file = write_job(tmp_path)
    job = load_job(job_file)
    first_half = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=job.train.steps // 2))
    run_one_site(first_half, tmp_path / "one-site", quiet=True, timeout=JOB_TIMEOUT)
    for name in job.stages:  # what `nebula demo --hot-start` does
        shutil.copytree(tmp_path / "one-site" / name / "checkpoints", tmp_path / "run0" / name / "checkpoints")

    sites = start_job(job_file)
    sites.wait()

    resumed = [r["step"] for r in records(sites.run / "encoder" / "metrics.jsonl") if r.get("event") == "resumed"]
    assert resumed == [job.train.steps // 2]  # continued where the single site stopped
    trained = records(sites.run / "encoder" / "metrics.jsonl", "step")
    assert [r["step"] for r in trained] == list(range(job.train.steps // 2 + 1, job.train.steps + 1))
    for name in job.stages:  # one site then two: every scheduled step applied once, in order
        assert json.loads((sites.run / name / "ledger.json").read_text())["steps"] == expected_ledger(job)


def test_translate_runs_the_encoder_here_and_the_decoder_at_the_other_site(tmp_path, start_job):
    job_file = write_job(tmp_path)
    sites = start_job(job_file)
    sites.wait()
    sites.stop()
    def arrived_at_b() -> int:
        return sum(1 for r in records(sites.run / "audit" / "b.jsonl", None)
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
