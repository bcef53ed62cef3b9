"""A one-site run's process as the OS and its own failures treat it, in a child process: stopped and
continued (SIGSTOP/SIGCONT: a Slurm job suspended, `docker pause`, a paused VM) for longer than its receive
timeout, it goes on where it was (the time it did not run is not its peers' silence; it used to fail at
once on resume with "no message within 300 s": an ELECTRA one-site run paused for a timing run,
2026-12-02); a stage failing while another is inside a torch op, it exits with the error's code (it used
to abort: std::terminate, exit 134, when the interpreter exited under that op)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys
from pathlib import Path
from nebula.transport.inproc import InProcHub
from tests.support.runtime import Running, example_job
# 30 steps of at least 0.1 s each at the sink: the job is mid-run when the parent stops it
job = example_job(steps=30, sink_impl="tests.support.runtime:CrashingSink", sink_options={"slow_apply": 0.1})
running = Running(job, Path(sys.argv[1]), InProcHub(), recv_timeout=3.0)
channels = {name: running.hub.channel(job.stage(name).address) for name in job.stages}  # all addresses first
for name in job.stages:
    running.start(name, channel=channels[name])
print("running", flush=True)
running.join(120)  # raises, naming each stage's error, if one failed
"""


def test_a_stage_process_stopped_for_longer_than_its_timeout_goes_on_when_continued(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        assert child.stdout.readline().strip() == "running"
        time.sleep(1.0)  # into the job: each stage waits for the other in turn
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(6.0)  # twice the stages' 3-s receive timeout
        os.kill(child.pid, signal.SIGCONT)
        out = child.communicate(timeout=120)[0]
    finally:
        child.kill()
    assert child.returncode == 0, out[-3000:]
    assert (tmp_path / "src" / "finished.json").is_file() and (tmp_path / "sink" / "finished.json").is_file()


def test_a_stage_failing_while_another_is_inside_a_torch_op_exits_with_its_error_not_an_abort(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text((REPO / "tests" / "e2e" / "jobs" / "pair.toml").read_text()
                   .replace('"tests.support.runtime:PacedSource"', '"tests.support.poison:TorchBusySource"')
                   .replace('"tests.support.runtime:PacedSink"', '"tests.support.poison:BuggySink"'))
    done = subprocess.run([sys.executable, "-m", "nebula.cli", "stage", "one-site", "--job", str(job), "--workdir",
                           str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "terminate called" not in done.stderr and done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.rstrip().endswith("nebula: error: stage sink failed on the single site: mat1 and mat2 shapes "
                                         "cannot be multiplied (8x20 and 16x1)")
