"""Job and site files parse into typed config, and every mistake is a ConfigError naming the file
and the key and saying what to fix, before any model loads."""
import copy
from pathlib import Path

import pytest

from nebula.errors import ConfigError
from nebula.runtime.job import load_job, parse_job
from nebula.runtime.registry import registered_stages, resolve_stage
from nebula.site.config import parse_site_config
from services.abnet.stages import DecoderOptions, EncoderOptions

ROOT = Path(__file__).resolve().parents[2]
BASE = {"job": {"name": "t", "data": "d"},
        "train": {"steps": 4, "batch_size": 8, "micro_batches": 2},
        "stages": {"encoder": {"address": "a/encoder/0", "impl": "abnet-encoder", "max_train_examples": 10},
                   "decoder": {"address": "b/decoder/0", "impl": "abnet-decoder", "objective": "ar"}},
        "links": [{"from": "encoder", "to": "decoder", "tensors": ["hidden", "mask"], "backward": True,
                   "compression": {"forward": "fp16", "backward": "int8"}}]}


def job(change=None, **sections):
    raw = copy.deepcopy(BASE)
    raw.update(sections)
    if change:
        change(raw)
    return parse_job(raw, source=Path("job.toml"))


def test_shipped_job_files_load_and_their_stages_resolve():
    for path in (ROOT / "deploy" / "jobs").glob("*.toml"):
        config = load_job(path)
        # a directory relative to the job file, or a data set registered at each site (users' jobs)
        assert config.data.startswith("dataset:") if path.stem.endswith("-users") else Path(config.data).is_absolute()
        for stage in config.stages.values():
            assert resolve_stage(stage.impl).stage_name == stage.impl
        if path.stem == "example-two-users":  # the two-user walkthrough of docs/operate.md §4
            assert [s.site for s in config.stages.values()] == ["a", "b"]
        elif path.name.startswith(("abnet", "transformer")):
            assert config.stage("encoder").site == "a" and config.stage("decoder").site == "b"
            assert [link.name for link in config.links] == ["encoder->decoder"] and config.links[0].backward
        elif path.name.startswith(("gpt", "minilm")):  # a chain of pipeline stages: activations forward,
            # gradients back (gpt2-*, minilm-*: the split workload's, its links' tensors found by the split)
            assert len(config.links) == len(config.stages) - 1 and all(link.backward for link in config.links)
        elif path.stem == "split-replicas":  # a model a user brings, whole, replicated (docs/replicas.md)
            assert len(config.stages) == 1 and not config.links and config.replicas.count == 2
        elif path.stem == "electra-generator":  # G's masked-LM phase before distillation: one stage, no links
            assert len(config.stages) == 1 and not config.links
        else:  # ELECTRA-Cloud: generators send ids one way to the discriminator
            assert path.name.startswith("electra") and config.schedule.name == "forward-only"
            assert all(not link.backward and link.dst == "disc" for link in config.links)
    assert {"abnet-encoder", "abnet-decoder", "example-source", "electra-generator"} <= set(registered_stages())


def test_stage_options_are_the_implementations_typed_dataclass():
    config = job()
    assert config.stage("encoder").options == EncoderOptions(max_train_examples=10)
    assert config.stage("decoder").options == DecoderOptions(objective="ar")
    assert config.graph.sources == ["encoder"] and config.graph.sinks == ["decoder"]
    assert config.graph.per_step("decoder") == 2 and config.graph.waits_for_gradients("encoder")


def _set(path, value):
    def change(raw):
        table = raw
        for key in path[:-1]:
            table = table[key] if not isinstance(key, int) else table[key]
        table[path[-1]] = value
    return change


@pytest.mark.parametrize("change, message", [
    (_set(["train", "steps"], 0), r"job.toml: \[train\].steps: 0 must be >= 1"),
    (_set(["train", "batch_size"], 9), "multiple of micro_batches"),
    (_set(["train", "stepz"], 3), r"unknown key 'stepz' \(did you mean 'steps'\?\)"),
    (_set(["train", "seed"], "abc"), r"\[train\].seed: expected an integer, got 'abc'"),
    (_set(["train", "seed"], 20000000000000), r"\[train\].seed: 20000000000000 must be >= 0 and <= 4294967295"),
    (_set(["train", "seed"], -1), r"\[train\].seed: -1 must be >= 0 and <= 4294967295"),
    (_set(["train", "staleness"], 1),
     r'\[train\].staleness: the schedule is chosen by name now: \[schedule\] name = "one-step-stale"'),
    (_set(["train", "lr"], 1e-3), r"\[train\].lr: lr is an option of each stage now"),
    (_set(["stages", "encoder", "lr"], "fast"), r"\[stages.encoder\].lr: expected a number, got 'fast'"),
    (_set(["stages", "encoder", "warmup_steps"], -5), r"\[stages.encoder\].warmup_steps: -5 must be >= 0"),
    (_set(["stages", "encoder", "max_train_exampels"], 5), r"did you mean 'max_train_examples'"),
    (_set(["stages", "decoder", "objective"], "mlm"), r"objective: 'mlm' is not one of 'ar', 'cmlm'"),
    (_set(["stages", "decoder", "ranks"], 0), r"ranks: 0 must be >= 1"),
    (_set(["stages", "decoder", "device"], "gpu"), r"'gpu' is not a device"),
    (_set(["stages", "encoder", "address"], "a/encoder/1"), "is not site/stage/0"),
    (_set(["stages", "encoder", "impl"], "no-such-stage"), "unknown stage 'no-such-stage'"),
    (_set(["links", 0, "to"], "decodr"), "no stage 'decodr'"),
    (_set(["links", 0, "tensors"], ["hiden", "mask"]), r"has no output 'hiden'; its outputs: hidden, mask"),
    (_set(["links", 0, "tensors"], ["hidden"]), r"decoder needs mask from every link that feeds it"),
    (lambda raw: raw["links"][0].pop("backward"), r"\[\[links\]\] encoder->decoder: `backward` is required"),
    (_set(["links", 0, "compression"], {"forward": "fp16(svd(2))"}), r"encoder->decoder.compression.forward"),
    (_set(["schedule"], {"name": "forward-only"}), r'backward = true under \[schedule\] name = "forward-only"'),
    (_set(["schedule"], {"name": "eventually"}), r"\[schedule\].name: 'eventually' is not one of"),
    (_set(["compression"], {"forward": "fp16"}), r"\[compression\] is per link now"),
    (_set(["extra"], {}), "unknown section"),
    (_set(["stages"], {}), "at least one"),
])
def test_mistakes_name_the_file_and_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        job(change)


def test_a_cycle_is_refused():
    raw = copy.deepcopy(BASE)
    raw["stages"] = {name: {"address": f"{site}/{name}/0", "impl": "example-middle"}
                     for name, site in (("x", "a"), ("y", "b"))}
    raw["links"] = [{"from": "x", "to": "y", "tensors": ["hidden"], "backward": True},
                    {"from": "y", "to": "x", "tensors": ["hidden"], "backward": True}]
    with pytest.raises(ConfigError, match="the links form a cycle through x, y"):
        parse_job(raw)


def test_a_source_must_read_data():
    raw = copy.deepcopy(BASE)
    raw["stages"] = {"x": {"address": "a/x/0", "impl": "tests.support.runtime:NoData"},
                     "y": {"address": "b/y/0", "impl": "example-sink"}}
    raw["links"] = [{"from": "x", "to": "y", "tensors": ["hidden"], "backward": True}]
    with pytest.raises(ConfigError, match="stage x is fed by no link, so it reads data, but NoData has no examples"):
        parse_job(raw)


@pytest.mark.parametrize("compression, named", [
    ({"forward": "fp16", "backward": "ef(topk(0.01))"}, "backward names"),
    ({"phases": [{"steps": 2, "forward": "fp16"}, {"steps": 2, "backward": "int8"}]}, r"phases\[1\].backward names"),
    ({"overrides": {"hidden": {"backward": "int8"}}}, "overrides.hidden.backward names"),
])
def test_a_backward_codec_on_a_forward_only_link_is_refused(compression, named):
    """It used to load and never be used: the job said it compressed gradients it never sent."""
    raw = {"job": {"name": "t"}, "schedule": {"name": "forward-only"},
           "stages": {"src": {"address": "a/src/0", "impl": "example-source", "local_loss": True},
                      "sink": {"address": "b/sink/0", "impl": "example-sink"}},
           "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": False,
                      "compression": compression}]}
    with pytest.raises(ConfigError, match=f"src->sink.compression: {named}.*backward = false"):
        parse_job(raw)
    raw["links"][0]["compression"] = "auto"  # both directions, of which this link has one: fine
    assert parse_job(raw).links[0].compression.phases[0].forward.codec.spec == "auto"


def test_unknown_stage_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="abnet-encoder"):
        resolve_stage("no-such-stage")
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_stage("no.such.module:Stage")
    for malformed in (":", ".x:Stage", "nebula:"):  # ValueError, TypeError, AttributeError from importlib
        with pytest.raises(ConfigError, match="cannot be imported.*expected 'package.module:Class'"):
            resolve_stage(malformed)
    with pytest.raises(ConfigError, match="not a subclass of nebula.runtime.stage.Stage"):
        resolve_stage("pathlib:Path")


def test_missing_job_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "nope.toml")


def test_language_pair_jobs_differ_only_in_their_data():
    """abnet-es-en and abnet-zh-en run the same schedule and decoding (they drifted apart once)."""
    es, zh = (load_job(ROOT / "deploy" / "jobs" / f"abnet-{pair}.toml") for pair in ("es-en", "zh-en"))
    assert es.train == zh.train and es.schedule == zh.schedule and es.links == zh.links
    assert es.stages == zh.stages
    assert Path(es.data).name == "es-en" and Path(zh.data).name == "zh-en"


SITE = {"site": {"name": "a", "credentials": "credentials/a", "run": "run"},
        "gateway": {"internal": "tcp://127.0.0.1:5601", "external": "tcp://127.0.0.1:5600"},
        "peers": {"b": {"endpoint": "tcp://127.0.0.1:5700"}}}


@pytest.mark.parametrize("section, key, value, message", [
    ("channel", "window_messages", "8", r"a.toml \[channel\].window_messages: expected an integer, got '8'"),
    ("channel", "resend_timeout", -1.0, r"resend_timeout = -1.0 must be > 0"),
    ("gateway", "hwm", 1.5, r"a.toml \[gateway\].hwm: expected an integer, got 1.5"),
    ("site", "audit", 7, r"a.toml \[site\].audit: expected a string, got 7"),
    ("site", "nmae", "a", r"a.toml \[site\]: unknown key 'nmae' \(did you mean 'name'\?\)"),
    ("peers", "b", "tcp://x:1", r"`b` must be a table"),
])
def test_site_file_mistakes_name_the_file_and_the_key(section, key, value, message):
    raw = copy.deepcopy(SITE)
    raw.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=message):
        parse_site_config(raw, source="a.toml")


def test_the_one_writer_of_job_files_checks_before_it_writes_and_writes_what_loads(tmp_path):
    from nebula.runtime.job_file import override, read_job_table, write_job_file

    source = ROOT / "deploy" / "jobs" / "abnet-es-en.toml"
    table = read_job_table(source)
    assert Path(table["job"]["data"]).is_absolute()  # it can be written anywhere
    job = write_job_file(tmp_path / "job.toml", override(table, train={"steps": 3}, stages={"decoder": {"lr": 0.5}}),
                         note="a test's copy")
    assert (tmp_path / "job.toml").read_text().startswith("# a test's copy\n")
    loaded = load_job(tmp_path / "job.toml")
    assert loaded.train.steps == job.train.steps == 3 and loaded.stage("decoder").options.lr == 0.5
    assert loaded.data == load_job(source).data
    with pytest.raises(ConfigError, match=r"\[train\].steps"):
        write_job_file(tmp_path / "bad.toml", override(table, train={"steps": -1}))
    assert not (tmp_path / "bad.toml").exists()  # refused before any file exists
    with pytest.raises(ConfigError, match="no stage 'decodr' to change"):
        override(table, stages={"decodr": {"lr": 0.5}})
