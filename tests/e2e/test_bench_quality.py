"""`nebula bench wan --quality --seeds`: every seed trains every setting through the real sites, both
held-out splits are scored, each setting is compared with the first over seeds, and a second call
keeps the finished runs instead of training them again."""
import json
import subprocess
import sys

import pytest

from nebula_lab.bench.wan_quality import slug
from tests.support.sites import JOB_TIMEOUT, terminate_once_training, write_job

LOSSY = "int8(lowrank(0.5))"


def bench(job, work, *more):
    return subprocess.run([sys.executable, "-m", "nebula.cli", "bench", "wan", "--scenario", "abnet", "--quality",
                           "--job", str(job), "--steps", "2", "--seeds", "1,2", "--setting", "none", "none",
                           "--setting", LOSSY, LOSSY, "--eval-splits", "valid,test", "--eval-sentences", "8",
                           "--workdir", str(work), "--json", *more],
                          capture_output=True, text=True, timeout=6 * JOB_TIMEOUT)


@pytest.mark.slow  # ~57 s on H1, the default suite's longest test: the bench is lab tooling, run on demand
def test_seeds_times_settings_scored_on_both_splits_and_compared_with_the_reference(tmp_path):
    job, work = write_job(tmp_path), tmp_path / "work"
    done = bench(job, work, "--setting-staleness", "0,1")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    runs = [r for r in out if not r.get("summary")]
    assert [(r["seed"], r["forward"], r["staleness"]) for r in runs] == [
        (1, "none", 0), (1, LOSSY, 1), (2, "none", 0), (2, LOSSY, 1)]
    for r in runs:
        assert r["steps"] == 2 and {"bleu_valid", "bleu_test"} <= set(r)
        schedule = (work / f"seed{r['seed']}").glob(f"*stale{r['staleness']}/job.toml")
        assert ("one-step-stale" if r["staleness"] else "synchronous") in next(schedule).read_text()
    assert runs[1]["forward_ratio"] < 0.5 < runs[0]["forward_ratio"]  # the codec was on the wire
    sent = [json.loads(line) for line in (work / "seed1" / f"{slug(LOSSY, LOSSY)}__stale1" / "encoder" /
                                           "link.jsonl").read_text().splitlines()]
    sent = [r for r in sent if r.get("dir") == "forward" and "raw" in r]
    assert {r.get("split") for r in sent} == {None, "valid", "test"}  # evaluation's tensors say so
    training = [r for r in sent if "split" not in r]
    assert runs[1]["forward_ratio"] == round(sum(r["wire"] for r in training) / sum(r["raw"] for r in training), 4)
    for split in ("valid", "test"):
        hyps = (work / "seed2" / "none__none__stale0" / "decoder" / f"{split}.hyp").read_text().splitlines()
        assert len(hyps) == 8
    summary = [r for r in out if r.get("summary")]
    assert [(r["split"], r["seeds"], r["sentences"]) for r in summary] == [("valid", [1, 2], 8), ("test", [1, 2], 8)]
    for r in summary:
        assert len(r["per_seed"]) == 2 and r["interval"][0] <= r["mean_diff"] <= r["interval"][1]
        assert r["reference"] == [runs[0][f"bleu_{r['split']}"], runs[2][f"bleu_{r['split']}"]]
    assert json.loads((work / "seeds.json").read_text()) == summary

    # nothing trains twice; each lossy run's weights are scored again uncompressed, on one site
    again = bench(job, work, "--setting-staleness", "0,1", "--eval-uncompressed")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("kept") == 4 and "step 1/2" not in again.stderr
    assert again.stderr.count("uncompressed (its step-2 weights, on one site)") == 2
    kept = json.loads(again.stdout)  # another job trains again: tests/unit/test_bench_quality_kept.py
    runs, summary = [r for r in kept if not r.get("summary")], [r for r in kept if r.get("summary")]
    assert [{k: v for k, v in r.items() if k != "uncompressed"} for r in runs] + \
        [r for r in summary if r["eval"] == "codecs"] == out
    for r in runs[0::2]:  # the reference had no codec: it is its own uncompressed score
        assert r["uncompressed"] == {"run": r["run"], **{k: r[k] for k in ("bleu", "test_sentences",
                                                                              "bleu_valid", "bleu_test")}}
    for r in runs[1::2]:
        plain = work / f"seed{r['seed']}" / f"{slug(LOSSY, LOSSY)}__stale1"
        assert r["uncompressed"]["run"] == str(plain / "uncompressed")
        assert "compression" not in (plain / "uncompressed" / "job.toml").read_text()
        for split in ("valid", "test"):
            assert len((plain / "uncompressed" / "decoder" / f"{split}.hyp").read_text().splitlines()) == 8
    assert [(r["split"], r["eval"]) for r in summary] == [
        ("valid", "codecs"), ("valid", "uncompressed"), ("test", "codecs"), ("test", "uncompressed")]
    for r in summary[1::2]:
        assert r["reference"] == [runs[0][f"bleu_{r['split']}"], runs[2][f"bleu_{r['split']}"]]
        assert len(r["per_seed"]) == 2 and r["interval"][0] <= r["mean_diff"] <= r["interval"][1]


def test_a_staleness_list_that_does_not_match_the_settings_is_refused(tmp_path):
    done = bench(write_job(tmp_path), tmp_path / "work", "--setting-staleness", "0,1,1")
    assert done.returncode != 0
    assert "--setting-staleness gives 3 values for 2 settings" in done.stderr
    assert not (tmp_path / "work" / "seed1").exists()


def test_a_killed_bench_stops_the_sites_it_started_and_keeps_no_half_run(tmp_path):
    """SIGTERM stops `nebula bench wan` as Ctrl-C does: it used to die at once and leave both gateways
    and both stages training; the unfinished run has no row.json, so the same command trains it again."""
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "nebula.cli", "bench", "wan", "--scenario", "abnet", "--quality", "--job",
           str(write_job(tmp_path)), "--steps", "400", "--seeds", "1", "--setting", "none", "none",
           "--workdir", str(work)]
    run = work / "seed1" / slug("none", "none")
    terminate_once_training(cmd, run)
    assert not (run / "row.json").exists()
