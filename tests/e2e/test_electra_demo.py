"""`nebula demo electra` end to end, tiny: G's MLM phase, a one-site phase starting G from it, then a
hot start across two sites (real gateways, CURVE, a process per stage), the loss plot, the verdict on
the switch, the held-out evaluations before/after (`nebula electra eval`'s), the plain words on what
the run shows, and the report."""
import json
import shutil
import signal
import subprocess
import sys

import tomllib

from nebula.runtime.job_file import write_job_file
from tests.support.sites import E2E, JOB_TIMEOUT, records

STEPS, ONE_SITE, GENERATOR = 40, 24, 6  # k = 12 steps each side of the switch for the verdict

JOB = """[job]
name = "electra-tiny"
data = "{data}"

[train]
steps = 40
batch_size = 4
micro_batches = 1
checkpoint_every = 12            # the one-site phase keeps its step-0 checkpoint (3 are kept)
log_every = 1
seed = 1

[schedule]
name = "forward-only"
credit = 2

[stages.generator]
address = "a/generator/0"
impl = "electra-generator"
corpus = "es-en"
vocab_corpora = ["es-en"]
max_len = 32
warmup_steps = 2
size = {{hidden = 16, layers = 1, heads = 2, ffn = 32}}

[stages.disc]
address = "{disc_site}/disc/0"
impl = "electra-discriminator"
vocab_corpora = ["es-en"]
max_len = 32
warmup_steps = 2
size = {{hidden = 32, layers = 1, heads = 2, ffn = 64}}

[[links]]
from = "generator"
to = "disc"
tensors = ["tokens", "positions", "originals"]
backward = false

[links.compression]
forward = "deflate"
"""


def tiny_data(root):
    """The e2e slice of es-en; its test split is one package, so half of it is relabelled as a second
    package for the probe (which needs at least two)."""
    data = root / "data"
    shutil.copytree(E2E / "data" / "es-en", data / "es-en")
    ids = (data / "es-en" / "test.ids").read_text().splitlines()
    relabelled = [i if k < len(ids) // 2 else "other" + i[i.index(":"):] for k, i in enumerate(ids)]
    (data / "es-en" / "test.ids").write_text("\n".join(relabelled) + "\n")
    return data


def demo(*args, timeout=3 * JOB_TIMEOUT) -> subprocess.CompletedProcess:
    """`nebula demo electra ARGS`; on a timeout it is interrupted (SIGINT), so that it stops the gateways
    and stages it started before the test fails: none is left behind."""
    proc = subprocess.Popen([sys.executable, "-m", "nebula.cli", "demo", "electra", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"nebula demo electra timed out after {timeout} s\n{out[-3000:]}{err[-3000:]}") from exc
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_electra_demo_hot_starts_across_sites_and_reports(tmp_path):
    data = tiny_data(tmp_path)
    jobs = {}
    for name, site in (("job.toml", "b"), ("one-site.toml", "a")):
        jobs[name] = tmp_path / name
        write_job_file(jobs[name], tomllib.loads(JOB.format(data=data, disc_site=site)))
    run = tmp_path / "run"

    done = demo("--job", jobs["job.toml"], "--one-site-job", jobs["one-site.toml"], "--steps", STEPS,
                "--one-site-steps", ONE_SITE, "--generator-steps", GENERATOR, "--run-dir", run)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("generator", "disc"):  # the cross-site run continued the one-site run at step N1
        metrics = run / "two-site" / name / "metrics.jsonl"
        assert [r["step"] for r in records(metrics, None) if r.get("event") == "resumed"] == [ONE_SITE]
        assert [r["step"] for r in records(metrics, "step")] == list(range(ONE_SITE + 1, STEPS + 1))
        one_site = records(run / "one-site" / name / "metrics.jsonl", "step")
        assert [r["step"] for r in one_site] == list(range(1, ONE_SITE + 1))
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (run / "report.md").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["untrained"].endswith("one-site/disc/checkpoints/step-00000000.pt")
    corruptor = run / "generator" / "generator" / "checkpoints" / f"step-{GENERATOR:08d}.pt"
    assert [r["step"] for r in records(run / "generator" / "generator" / "metrics.jsonl", "step")] == \
        list(range(1, GENERATOR + 1))  # G's MLM phase ran alone, first
    assert summary["corruptor"] == str(corruptor) and corruptor.exists()
    for job in ("job.toml", "job-one-site.toml"):  # distillation starts G from that phase
        assert tomllib.loads((run / job).read_text())["stages"]["generator"]["init"] == str(corruptor.resolve())
    rows = summary["evaluation"]["rows"]
    assert [(r["task"], r["metric"].split(",")[0]) for r in rows] == [
        ("MLM", "corruptor G"), ("RTD", "ROC-AUC"), ("RTD", "accuracy at p = 0.5"),
        ("CLM", "D accuracy at masked positions"), ("alignment es-en", "own translation ranked first"),
        ("alignment es-en", "own translation ranked first: D against the shared-token baseline"),
        ("alignment es-en", "own translation ranked first")]  # ..., N pairs with no shared-token cue
    assert all(r["verdict"] in ("better", "worse", "within") and len(r["after"]) == 1 for r in rows)
    assert summary["evaluation_text"] in report and summary["evaluation_text"] in done.stdout
    assert summary["shows"].startswith("What this run shows") and "What it does not show" in summary["shows"]
    assert summary["shows"] in report and summary["shows"] in done.stdout
    assert "![loss curves](loss.png)" in report and "hot start:" in report and "hot start:" in done.stdout
    assert {name: v["k"] for name, v in summary["verdicts"].items()} == {"generator": 12, "disc": 12}
    assert all(v["ok"] in (True, False) and v["sigma"] > 0 for v in summary["verdicts"].values())
    assert summary["transfer"]["two-site"]["bytes_per_token"] > 0
    assert summary["transfer"]["wan"]["a"] > summary["transfer"]["two-site"]["payload_bytes"]  # + envelopes


def test_electra_demo_refuses_a_run_dir_with_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    done = demo("--run-dir", run, timeout=60)
    assert done.returncode != 0
    assert "already holds files" in done.stderr and "does not delete" in done.stderr
    assert (run / "notes.txt").read_text() == "mine"
