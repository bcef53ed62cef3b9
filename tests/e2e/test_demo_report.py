"""`nebula demo` as a user sees it, on a small run: the example table, the report beside the loss
plot, translations that depend on the input, and `nebula translate` one line at a time."""
import subprocess
import sys

from services.abnet.report import EXAMPLES
from tests.support.sites import JOB_TIMEOUT, terminate_once_training, write_job

# The demo's learning rates and adapters (deploy/jobs/abnet-es-en.toml), 60 steps: with the tiny job's
# (5e-4 both sides, adapters on every layer) 40 steps gave 23 of 24 inputs the same word, as the full demo
# at 200 steps gave every input one sentence before its settings changed (docs/abnet.md); these gave 10
# different translations of 24 (H2, 2026-12-02). A checkpoint at 30 and 60, not every 2 steps: the
# decoder's is 100 MB, written in 0.3 s, as long as a step
SMALL = {"steps = 8": "steps = 60", "checkpoint_every = 2": "checkpoint_every = 30",
         "lr = 5e-4\nwarmup_steps = 5\neval_examples = 16": "lr = 2e-4\nadapter_layers = 4\nwarmup_steps = 5\n"
                                                          "eval_examples = 24",
         "lr = 5e-4\nwarmup_steps = 5\nobjective": "lr = 1e-3\nadapter_layers = 2\nwarmup_steps = 5\nobjective"}


def test_the_demo_shows_held_out_examples_writes_its_report_and_translates_line_by_line(tmp_path):
    run = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "nebula.cli", "demo", "--job", str(write_job(tmp_path, SMALL)),
                           "--run-dir", str(run)], capture_output=True, text=True, timeout=3 * JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]

    sources = (run / "encoder" / "test.src").read_text().splitlines()
    hyps = (run / "decoder" / "test.hyp").read_text().splitlines()
    assert len(sources) == len(hyps) == 24
    shown = [line.split("es:", 1)[1].strip() for line in done.stdout.splitlines() if line.strip().startswith("es:")]
    assert shown == [sources[i * 24 // EXAMPLES] for i in range(EXAMPLES)]  # evenly spaced, not chosen
    assert "BLEU" in done.stdout and "sent a->b" in done.stdout and "60 steps" in done.stdout
    # what it will show, up front, then how long the rest takes here once steps 10-30 are timed
    assert done.stdout.startswith("nebula demo: ") and "It shows BLEU with its 95% interval" in done.stdout
    assert "at this machine's pace" in done.stdout and "min translating 24 sentences" in done.stdout
    report = (run / "report.md").read_text()
    assert report.count("\n| ") == EXAMPLES + 1 and "![training loss](loss.png)" in report
    assert (run / "loss.png").stat().st_size > 0
    assert len(set(hyps)) >= 3, hyps  # the translation depends on the source

    typed = "Candidato:\n\nNo se puede abrir el archivo\n"
    answered = subprocess.run([sys.executable, "-m", "nebula.cli", "translate", "--run-dir", str(run), "--interactive"],
                              input=typed, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert answered.returncode == 0, answered.stderr[-3000:]
    lines = answered.stdout.splitlines()
    assert len(lines) == 3 and lines[1] == "" and lines[0] and lines[2]  # one line out per line in


def test_a_terminated_demo_stops_the_sites_it_started(tmp_path):
    """SIGTERM (a `timeout`, a `kill`, a container stop) stops the demo as Ctrl-C does: it used to die
    at once and leave both gateways and both stages running."""
    run = tmp_path / "demo"
    terminate_once_training([sys.executable, "-m", "nebula.cli", "demo", "--job", str(write_job(tmp_path, SMALL)),
                             "--run-dir", str(run)], run)
