"""nebula_lab.bench.cpu on real processes: a busy one and an idle one, sampled from /proc while they run."""
import subprocess
import sys
import time

import pytest

from nebula_lab.bench.cpu import CpuSampler, cpu_seconds, per_step, read_samples

BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(5)"


def test_a_busy_process_is_counted_under_its_kind_and_an_idle_one_costs_nothing(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        kinds = {busy.pid: "stages", idle.pid: "gateways"}
        with CpuSampler(tmp_path / "cpu.jsonl", lambda: kinds, interval_s=0.05) as sampler:
            deadline = time.monotonic() + 10
            while (cpu_seconds(busy.pid) or 0) < 0.6 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # at least one sample after the busy loop ended
    finally:
        busy.kill(), idle.kill()
    samples = read_samples(tmp_path / "cpu.jsonl")
    assert len(samples) >= 3 and samples[-1]["cpu"] == pytest.approx(sampler.read(), abs=0.05)
    first, last = samples[0]["cpu"], samples[-1]["cpu"]
    assert 0.6 <= last["stages"] <= 0.75 and last["gateways"] < 0.1  # the busy loop's 0.6 s, the idle one's start-up
    whole = per_step(samples, samples[0]["t"], samples[-1]["t"], steps=2)
    assert whole["stages"] == pytest.approx((last["stages"] - first["stages"]) / 2, abs=1e-4)
    assert whole["stages"] > 0.2  # most of the loop ran between the first and the last sample
    assert whole["gateways"] < 0.05
    totals = [s["cpu"]["stages"] for s in samples]
    assert totals == sorted(totals)  # cumulative: a window's cost is a difference of two samples


def test_a_process_that_exits_keeps_its_last_reading_and_a_window_before_the_samples_is_none(tmp_path):
    short = subprocess.Popen([sys.executable, "-c", BUSY.replace("time.sleep(5)", "")])
    with CpuSampler(tmp_path / "cpu.jsonl", lambda: {short.pid: "stages"}, interval_s=0.05):
        short.wait(timeout=30)
        time.sleep(0.2)  # samples after the exit: the pid is gone from /proc
    samples = read_samples(tmp_path / "cpu.jsonl")
    assert cpu_seconds(short.pid) is None
    assert samples[-1]["cpu"]["stages"] >= 0.5
    assert per_step(samples, samples[0]["t"] - 10, samples[-1]["t"], steps=1) is None
    assert read_samples(tmp_path / "none.jsonl") == []
