"""Status files, health, the Prometheus exporter and TensorBoard scalars (nebula.observe), and a real
in-process training run whose source stage reports through them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from nebula.cli import main as cli_main
from nebula.errors import ConfigError, DataError
from nebula.gateway.meter import Meter
from nebula.observe import observer as observer_module
from nebula.observe.observer import Observer, Observing
from nebula.observe.prometheus import Exporter, metrics_endpoint
from nebula.observe.stage import LinkTail, MeteredChannel, StageWatch
from nebula.observe.status import health, identity, read_status, record_exit, write_status
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.service import build_stage, make_runner
from nebula.site.ports import free_port
from nebula.transport.base import Channel
from nebula.transport.inproc import InProcHub
from nebula.wire import Kind, Message
from tests.support.runtime import example_job


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def status_of(state="running", pid=None, age=0.0, **extra) -> dict:
    record = {**identity("gateway", "gateway", "a/gateway/0"), "state": state, "updated": time.time() - age}
    if pid is not None:
        record.update(pid=pid, pid_start=None)
    return {**record, **extra}


@pytest.fixture(autouse=True)
def no_observer_left():
    yield
    assert not observer_module._owner, "a test left an observer open"


def test_status_round_trips_atomically_and_bad_files_are_named(tmp_path):
    path = tmp_path / "gateway.json"
    write_status(path, status_of(bytes_in=5))
    assert read_status(path)["bytes_in"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["gateway.json"]  # the temporary file was renamed
    with pytest.raises(DataError, match="no status file .*missing.json"):
        read_status(tmp_path / "missing.json")
    (tmp_path / "torn.json").write_text('{"service": ')
    with pytest.raises(DataError, match="torn.json cannot be read as JSON"):
        read_status(tmp_path / "torn.json")
    (tmp_path / "other.json").write_text('{"services": []}')
    with pytest.raises(DataError, match="other.json is not a Nebula status file"):
        read_status(tmp_path / "other.json")


def test_health_needs_a_fresh_file_a_live_pid_and_a_live_state(tmp_path):
    path = tmp_path / "s.json"
    write_status(path, status_of())
    assert health(path).ok and "gateway running: pid" in health(path).reason
    write_status(path, status_of(age=30))
    assert not health(path, max_age=10).ok and "not updated for 30 s" in health(path, max_age=10).reason
    write_status(path, status_of(state="failed", error="ConfigError: bad key"))
    assert not health(path).ok and health(path).reason.endswith("ConfigError: bad key")
    write_status(path, status_of(state="degraded", error="audit log: cannot write a.jsonl: No space left on device"))
    assert not health(path).ok and "gateway is degraded" in health(path).reason
    assert health(path).reason.endswith("No space left on device")
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    write_status(path, status_of(pid=exited.pid))
    assert not health(path).ok and f"pid {exited.pid} is not running" in health(path).reason
    reused = status_of()
    reused["pid_start"] += 1  # this pid, but not the process that wrote the file
    write_status(path, reused)
    assert not health(path).ok and "is not running" in health(path).reason
    write_status(path, status_of(pid=exited.pid, host="elsewhere"))  # freshness alone decides there
    assert health(path).ok and "on host elsewhere (pid not checked" in health(path).reason
    assert not health(tmp_path / "none.json").ok


def test_record_exit_fills_in_what_a_killed_service_could_not_write(tmp_path):
    path = tmp_path / "s.json"
    for code, asked, state in ((0, False, "done"), (-9, False, "failed"), (-15, True, "stopped"), (2, False, "failed")):
        write_status(path, status_of())
        record_exit(path, code, asked_to_stop=asked)
        record = read_status(path)
        assert (record["state"], record["exit_code"]) == (state, code)
    assert read_status(path)["error"] == "exited with code 2"
    write_status(path, status_of(state="done"))
    record_exit(path, 1)  # the service's own final word stands
    assert read_status(path)["state"] == "done"
    record_exit(tmp_path / "never-written.json", 1)
    assert not (tmp_path / "never-written.json").exists()


def test_the_environment_turns_observation_on_and_its_values_are_checked(tmp_path):
    assert Observing.from_env({}) is None
    assert metrics_endpoint({"NEBULA_METRICS_PORT": "0"}) is None
    assert metrics_endpoint({"NEBULA_METRICS_PORT": "9400"}) == ("127.0.0.1", 9400)
    assert metrics_endpoint({"NEBULA_METRICS_PORT": "9400", "NEBULA_METRICS_BIND": "0.0.0.0"}) == ("0.0.0.0", 9400)
    for bad in ("nine", "70000", "-1"):
        with pytest.raises(ConfigError, match=f"NEBULA_METRICS_PORT={bad!r}|NEBULA_METRICS_PORT={bad}"):
            metrics_endpoint({"NEBULA_METRICS_PORT": bad})
    env = {"NEBULA_STATUS_FILE": str(tmp_path / "status" / "enc.json"), "NEBULA_SERVICE": "encoder"}
    observing = Observing.from_env(env)
    assert observing == Observing("encoder", tmp_path / "status" / "enc.json", None)
    first = observing.observer("stage", "a/encoder/0", lambda: {"step": 3}, "enc").start()
    try:
        assert read_status(tmp_path / "status" / "enc.json")["service"] == "encoder"
        with pytest.raises(ConfigError, match="one service per process"):
            observing.observer("stage", "a/other/0", dict, "other")
    finally:
        first.close("done")
    record = read_status(tmp_path / "status" / "enc.json")
    assert (record["state"], record["step"], record["address"]) == ("done", 3, "a/encoder/0")


def test_exporter_serves_the_status_record_and_names_a_busy_port(tmp_path):
    record = status_of(peers={"b": {"messages_in": 4, "bytes_in": 400, "messages_out": 2, "bytes_out": 90,
                                    "resend_requests": 1}},
                       refusals={"spoof": 1}, dropped={"to:b": 2}, queues={"internal": 3},
                       rate_limited={"a/enc/0": 7}, handshakes={"admitted": 2, "refused": 5},
                       queued_bytes={"to:b": 4096})
    port = free_port()
    exporter = Exporter("127.0.0.1", port, lambda: record).start()
    try:
        text = scrape(port)
        with pytest.raises(ConfigError, match=f"metrics port {port} on 127.0.0.1 is already in use"):
            Exporter("127.0.0.1", port, dict).start()
    finally:
        exporter.close()
    for line in ('nebula_gateway_messages_total{direction="in",peer="b"} 4.0',
                 'nebula_gateway_bytes_total{direction="out",peer="b"} 90.0',
                 'nebula_gateway_resend_requests_total{peer="b"} 1.0',
                 'nebula_gateway_refusals_total{reason="spoof"} 1.0',
                 'nebula_gateway_dropped_total{link="to:b"} 2.0',
                 'nebula_gateway_queue_depth{socket="internal"} 3.0',
                 'nebula_gateway_rate_limited_total{sender="a/enc/0"} 7.0',
                 'nebula_gateway_handshakes_total{result="refused"} 5.0',
                 'nebula_gateway_queued_bytes{hop="to:b"} 4096.0',
                 'nebula_service_state{nebula_service_state="running"} 1.0',
                 'nebula_service_info{address="a/gateway/0",kind="gateway",service="gateway"} 1.0'):
        assert line in text, line


def test_gateway_meter_counts_peers_both_ways():
    meter = Meter()
    meter.passed("a/enc/0", "in", 100)
    meter.passed("b", "out", 100)
    meter.passed("b", "in", 20, resend=True)
    status = meter.status()
    assert (status["messages_in"], status["bytes_in"], status["bytes_out"]) == (2, 120, 100)
    assert status["peers"]["b"] == {"messages_in": 1, "bytes_in": 20, "messages_out": 1, "bytes_out": 100,
                                    "resend_requests": 1}


def test_link_tail_sums_what_the_links_encoded_and_waits_for_whole_lines(tmp_path):
    path = tmp_path / "link.jsonl"

    def line(step, codec, raw, wire):
        return json.dumps({"step": step, "link": "s->t", "dir": "forward", "codec": codec, "raw": raw, "wire": wire})
    path.write_text(line(1, "none", 9, 9) + "\n")
    tail = LinkTail(path)  # what was there before this process started is not its traffic
    with open(path, "a") as f:  # step 1: the hidden states in fp16, their mask as it is; half a line of step 2
        f.write(line(1, "fp16", 4096, 2048) + "\n" + line(1, "none", 64, 64) + "\n" + line(2, "int8", 4096, 1088)[:20])
    assert tail.read() == {"s->t:forward": {"codec": "fp16", "ratio": round(4160 / 2112, 3), "raw_bytes": 4160,
                                            "wire_bytes": 2112}}
    with open(path, "a") as f:  # a new phase from step 2 on: the codec and ratio are the latest step's
        f.write(line(2, "int8", 4096, 1088)[20:] + "\n")
    now = tail.read()["s->t:forward"]
    assert (now["codec"], now["ratio"], now["wire_bytes"]) == ("int8", round(4096 / 1088, 3), 2112 + 1088)


def test_link_tail_reads_past_auto_switches_and_keeps_evaluations_out_of_the_step_ratio(tmp_path):
    """link.jsonl also holds `auto`'s switch events and an evaluation's tensors (with their split):
    the first are not tensors, the second crossed the link but are no part of the latest step."""
    path = tmp_path / "link.jsonl"
    tail = LinkTail(path)
    records = [{"step": 5, "link": "s->t", "dir": "forward", "codec": "int8", "raw": 4096, "wire": 1088},
               {"kind": "auto", "link": "s->t", "dir": "forward", "step": 6, "old": "int8", "new": "none"},
               {"step": 5, "link": "s->t", "dir": "forward", "codec": "none", "raw": 4096, "wire": 4096,
                "split": "valid"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert tail.read() == {"s->t:forward": {"codec": "int8", "ratio": round(4096 / 1088, 3), "raw_bytes": 8192,
                                            "wire_bytes": 1088 + 4096}}


def test_link_tail_reports_delta_caches_in_memory_and_on_disk_and_prometheus_exports_them(tmp_path):
    from nebula.observe.prometheus import stage_families

    path = tmp_path / "link.jsonl"
    tail = LinkTail(path)

    def line(step, name, ram, disk, hits, split=None):
        cache = {"hits": hits, "misses": 4, "entries": 8, "ram_bytes": ram, "disk_bytes": disk, "spilled": 3}
        return json.dumps({"step": step, "link": "s->t", "dir": "forward", "name": name, "codec": "delta(int8)",
                           "raw": 4096, "wire": 1100, "cache": cache, **({"split": split} if split else {})})
    path.write_text("\n".join([line(1, "h", 100, 0, 0), line(2, "h", 60, 40, 4), line(2, "g", 10, 5, 1),
                               line(2, "h", 50, 70, 4, split="valid")]) + "\n")
    now = tail.read()["s->t:forward"]  # the latest of each tensor, an evaluation's included, summed over tensors
    assert now["delta_cache"] == {"entries": 16, "ram_bytes": 60, "disk_bytes": 75, "hits": 5, "misses": 8}
    families = stage_families({"links": {"s->t:forward": now}})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    assert samples[("nebula_stage_delta_cache_bytes", (("direction", "forward"), ("link", "s->t"),
                                                       ("where", "disk")))] == 75
    assert samples[("nebula_stage_delta_cache_lookups_total", (("direction", "forward"), ("link", "s->t"),
                                                               ("result", "hit")))] == 5


def test_metered_channel_counts_payload_and_body_bytes():
    hub = InProcHub()
    a, b = MeteredChannel(hub.channel("a/x/0")), MeteredChannel(hub.channel("a/y/0"))
    a.send(Message(kind=Kind.CONTROL, dst="a/y/0", body=b"12345"))
    assert b.recv(timeout=1).body == b"12345"
    assert a.counts()["messages_out"] == 1 and a.counts()["bytes_out"] == 5
    assert b.counts()["messages_in"] == 1 and b.counts()["bytes_in"] == 5


def test_a_training_stage_reports_its_steps_codecs_and_outcome(tmp_path):
    """The sink of a real two-stage run (fp16 forward, int8 backward) in-process: its status file and
    metrics endpoint follow its steps; the file says done at the end."""
    job = example_job(steps=4, compression={"forward": "fp16", "backward": "int8"})
    src = build_stage(job, "src", tmp_path / "src", quiet=True)  # not observed: no watch handed to it
    status, port = tmp_path / "status" / "sink.json", free_port()
    watch = StageWatch.start(Observing("", status, ("127.0.0.1", port)), "sink", "b/sink/0", tmp_path / "sink")
    assert read_status(status)["state"] == "starting"  # written before any step, while the model loads
    sink = build_stage(job, "sink", tmp_path / "sink", quiet=True, watch=watch)
    hub, scraped = InProcHub(), []
    src_runner = make_runner(job, "src", src, hub.channel("a/src/0"), timeout=20)
    sink_channel = hub.channel("b/sink/0")  # before src starts: its first message must find the sink
    thread = threading.Thread(target=src_runner.run, daemon=True)
    thread.start()
    with sink.context.metrics.watching(sink_channel) as channel:
        runner = make_runner(job, "sink", sink, channel, timeout=20)
        runner.run()
        watch.observer.publish()
        scraped.append(scrape(port))
        runner.close()
    thread.join(20)
    src_runner.close()
    record = read_status(status)
    assert (record["state"], record["step"], record["service"]) == ("done", 4, "sink")
    assert record["address"] == "b/sink/0"
    assert record["loss"] > 0 and record["step_s"] >= record["compute_s"] > 0
    assert record["wire_s"] == pytest.approx(record["step_s"] - record["compute_s"])
    backward = record["links"]["src->sink:backward"]
    assert backward["codec"].startswith("int8") and 3.5 < backward["ratio"] < 4.0  # fp32 -> int8 + block scales
    assert record["bytes_out"] > 0 and record["bytes_in"] > 0 and record["messages_in"] > 0
    assert f"nebula_stage_step {record['step']}.0" in scraped[0]
    assert f"nebula_stage_loss {record['loss']}" in scraped[0]
    ratio = f'nebula_stage_codec_ratio{{codec="{backward["codec"]}",direction="backward",link="src->sink"}}'
    assert ratio in scraped[0]


def test_a_stage_that_fails_says_so(tmp_path):
    watch = StageWatch.start(Observing("", tmp_path / "x.json", None), "x", "a/x/0", tmp_path / "x")
    metrics = MetricsLog(tmp_path / "x" / "metrics.jsonl", "x", watch=watch)
    with pytest.raises(RuntimeError):
        with metrics.watching(InProcHub().channel("a/x/0")):
            assert read_status(tmp_path / "x.json")["state"] == "running"
            raise RuntimeError("out of memory")
    record = read_status(tmp_path / "x.json")
    assert record["state"] == "failed" and record["error"] == "RuntimeError: out of memory"
    assert "x is failed" in health(tmp_path / "x.json").reason


def test_numbers_that_cannot_be_read_leave_the_status_moving_and_say_why(tmp_path, monkeypatch, caplog):
    """A bug in a metric (a KeyError, a value JSON cannot hold) must not stop the status thread or
    the service: the file keeps moving with the last numbers and `numbers_error`, health stays ok and
    says so, Prometheus marks them stale, each cause is logged once, and reading again mends it."""
    monkeypatch.setattr(observer_module, "INTERVAL", 0.02)
    now = {"numbers": {"step": 2}}

    def read():
        if isinstance(now["numbers"], Exception):
            raise now["numbers"]
        return now["numbers"]

    def written(check):
        record, deadline = None, time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                record = read_status(path)
                if check(record) and time.time() - record["updated"] < 1:
                    return record
            except DataError:
                pass  # between the temporary file and its rename
            time.sleep(0.01)
        raise AssertionError(f"no status record as expected; the last: {record}")

    path, port = tmp_path / "stage.json", free_port()
    observer = Observer("stage", "stage", "a/stage/0", read, path, ("127.0.0.1", port)).start(background=True)
    try:
        written(lambda r: r.get("step") == 2)
        now["numbers"] = KeyError("raw")
        record = written(lambda r: "numbers_error" in r)
        assert (record["numbers_error"], record["step"]) == ("KeyError: 'raw'", 2)  # the last ones, not zero
        first = record["updated"]
        assert written(lambda r: r["updated"] > first + 0.1)["numbers_error"] == "KeyError: 'raw'"  # still moving
        verdict = health(path)
        assert verdict.ok and "its numbers are stale (KeyError: 'raw')" in verdict.reason
        scraped = scrape(port)
        assert "nebula_service_numbers_stale 1.0" in scraped and "nebula_stage_step 2.0" in scraped
        now["numbers"] = {"step": object()}
        assert written(lambda r: r.get("numbers_error", "").startswith("TypeError"))["step"] == 2
        now["numbers"] = {"step": 3}
        assert "numbers_error" not in written(lambda r: r.get("step") == 3)  # mended
        assert "nebula_service_numbers_stale 0.0" in scrape(port)
        logged = [r.getMessage() for r in caplog.records if r.name == "nebula.observe"]
        assert len(logged) == 2 and all("cannot be read" in m for m in logged)  # once per cause
        now["numbers"] = KeyError("raw")
    finally:
        observer.close("done")  # with its numbers broken: the final state is still written
    assert read_status(path)["state"] == "done"


def test_a_status_file_that_cannot_be_written_does_not_stop_the_loop_that_writes_it(tmp_path, monkeypatch, caplog):
    """A gateway ticks from its message loop: a removed run directory (or a full disk) must cost
    the file, logged once, not the gateway; the next write after it is back succeeds."""
    monkeypatch.setattr(observer_module, "INTERVAL", 0.0)
    status = tmp_path / "status"
    observer = Observer("gateway", "gateway", "a/gateway/0", lambda: {"messages_in": 7}, status / "gateway.json")
    observer.start()
    try:
        shutil.rmtree(status)
        for _ in range(3):
            observer.tick()  # raised FileNotFoundError into the loop before
        assert observer.record["messages_in"] == 7  # what a scrape reads still moves
        logged = [r.getMessage() for r in caplog.records if r.name == "nebula.observe"]
        assert len(logged) == 1 and "cannot write its status file" in logged[0]
        status.mkdir()
        observer.tick()
        assert read_status(status / "gateway.json")["messages_in"] == 7
    finally:
        observer.close("stopped")
    assert read_status(status / "gateway.json")["state"] == "stopped"


def test_nebula_health_exit_codes_for_a_status_file(tmp_path, capsys):
    path = tmp_path / "gateway.json"
    write_status(path, status_of())
    assert cli_main(["health", str(path)]) == 0
    assert capsys.readouterr().out.startswith("healthy: gateway running")
    write_status(path, status_of(age=60))
    assert cli_main(["health", str(path), "--max-age", "5", "--json"]) == 1
    reply = json.loads(capsys.readouterr().out)
    assert reply[0]["ok"] is False and "not updated for 60 s" in reply[0]["reason"]
    assert cli_main(["health", "no-such-target"]) == 2
    assert "give a status file, a site config" in capsys.readouterr().err


def test_tensorboard_scalars_are_written_at_each_step(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard to test TensorBoard output")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricsLog(tmp_path / "metrics.jsonl", "src", quiet=True, tensorboard=True)
    for step in (1, 2):
        metrics.step(step=step, step_s=0.5, compute_s=0.2, loss=3.0 / step, sent={"src|sink:forward": 1000})
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.0), (2, 1.5)]
    assert events.Scalars("wire_s")[0].value == pytest.approx(0.3)
    assert "sent/src|sink:forward" in events.Tags()["scalars"]


def test_tensorboard_asked_for_but_not_installed_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without the package gives
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        MetricsLog(tmp_path / "metrics.jsonl", "src", tensorboard=True)


def test_a_metered_channel_passes_on_everything_a_channel_answers():
    """The status file's channel wraps the stage's: a Channel method it did not pass on answered the
    base class's default instead (goodput: None, so `compression = "auto"` never adapted under a
    supervisor that asks for a status file, as `nebula site up` does)."""
    answers = {name for name, value in vars(Channel).items() if callable(value) and not name.startswith("_")}
    assert answers <= set(vars(MeteredChannel)), answers - set(vars(MeteredChannel))


def test_a_link_that_carried_only_an_evaluation_is_read_without_a_training_codec(tmp_path):
    """A stage started after its job's last step evaluates again: link.jsonl then holds only `split`
    entries for this process, which once raised KeyError from every status write (issue 41, 3)."""
    tail = LinkTail(tmp_path / "link.jsonl")
    (tmp_path / "link.jsonl").write_text(json.dumps({"link": "encoder->decoder", "dir": "forward", "step": 8,
                                                     "split": "valid", "codec": "fp16", "raw": 400, "wire": 200})
                                         + "\n")
    assert tail.read() == {"encoder->decoder:forward": {"raw_bytes": 400, "wire_bytes": 200}}
