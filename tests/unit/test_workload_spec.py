"""One workload spec in one entry-point group (nebula.workload): the installed workloads are found through
it; a package installed beside them (a real .dist-info on sys.path, read by importlib.metadata) adds
stages, commands and data actions, and what is broken or claimed twice fails only what uses it; the lab
calls no scenario hook its protocols do not declare."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from nebula import workload
from nebula.cli import build_parser
from nebula.commands.demo import Demo, default_demo
from nebula.errors import ConfigError
from nebula.runtime import registry
from nebula.runtime.registry import registered_stages, resolve_stage
from nebula_lab.bench.scenarios import (
    DdpPeer,
    OwnBenchmark,
    Scenario,
    TimeToLoss,
    TorchPeer,
    hooks,
    kind_of,
    load_scenario,
    scenario_names,
)

ROOT = Path(__file__).resolve().parents[2]

SPECS = '''
from nebula.workload import Workload

TWIN_A = Workload(stages={"twin": "services.example.stages:Source", "spare": "plugin_stages:Spare",
                          "alias": "services.example.stages:Sink"})
TWIN_B = Workload(stages={"twin": "services.example.stages:Middle"})
CLASHING = Workload(commands={"keys": "plugin_specs:register_echo", "echo": "plugin_specs:register_echo"},
                    data={"list": "plugin_specs:register_echo", "extra": "plugin_specs:register_extra"})
NOT_A_SPEC = {"stages": {}}


def register_echo(sub):
    sub.add_parser("echo", help="a command from an installed package").set_defaults(func=lambda args: 0)


def register_extra(data_sub):
    data_sub.add_parser("extra", help="a data action from an installed package").set_defaults(func=lambda args: 0)
'''
ENTRY_POINTS = """[nebula.workloads]
twin-a = plugin_specs:TWIN_A
twin-b = plugin_specs:TWIN_B
clashing = plugin_specs:CLASHING
not-a-spec = plugin_specs:NOT_A_SPEC
gone = plugin_missing_module:WORKLOAD
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A package installed beside nebula-i, as pip would leave it: a module and its .dist-info."""
    (tmp_path / "plugin_specs.py").write_text(SPECS)
    (tmp_path / "plugin_stages.py").write_text("from services.example.stages import Sink\n\n\n"
                                               "class Spare(Sink):\n    pass\n")
    info = tmp_path / "nebula_test_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nebula-test-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_STAGES", dict(registry._STAGES))  # what the test registers goes with it
    workload.installed.cache_clear()
    yield workload.installed()
    workload.installed.cache_clear()


def test_the_repository_plugs_in_through_the_one_group():
    specs = workload.installed()
    assert {"abnet", "corpus", "electra", "example", "lab"} <= set(specs.loaded) and not specs.broken
    assert {"abnet", "electra"} <= set(scenario_names())
    for name, spec in specs.loaded.items():  # every reference of every spec names something that imports
        for ref in [*spec.commands.values(), *spec.data.values(), *filter(None, (spec.demo, spec.scenario))]:
            assert workload.load(ref, name) is not None
        for stage in spec.stages:
            assert resolve_stage(stage).stage_name == stage


def test_reading_every_spec_imports_no_torch():
    """`nebula --help` builds every command's parser from the specs; their stages load only when a job runs."""
    code = ("import sys; from nebula.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy', 'nacl', 'matplotlib', 'sacrebleu') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]" and done.stderr == ""


def test_a_stage_name_two_workloads_declare_is_refused_and_the_others_resolve(plugins):
    with pytest.raises(ConfigError, match=r"'twin' is declared by the workloads twin-a \(services.example.stages:"
                                          r"Source\) and twin-b \(services.example.stages:Middle\): uninstall one"):
        resolve_stage("twin")
    assert resolve_stage("spare").stage_name == "spare" and resolve_stage("example-sink").stage_name == "example-sink"
    with pytest.raises(ConfigError, match="Sink is registered as 'example-sink' already, not also as 'alias'"):
        resolve_stage("alias")
    assert {"twin", "spare", "example-source"} <= set(registered_stages())


def test_a_spec_that_cannot_load_is_named_where_it_may_be_the_cause(plugins):
    assert plugins.broken["gone"].startswith("plugin_missing_module:WORKLOAD: ModuleNotFoundError")
    assert "is dict, not a nebula.workload.Workload" in plugins.broken["not-a-spec"]
    with pytest.raises(ConfigError, match="unknown stage 'nope'.*workload plugin gone cannot be loaded"):
        resolve_stage("nope")


def test_commands_and_data_actions_of_an_installed_spec_and_what_is_left_out(plugins, capsys):
    commands = build_parser()._subparsers._group_actions[0].choices
    assert "echo" in commands and "translate" in commands and "bench" in commands
    data = commands["data"]._subparsers._group_actions[0].choices
    assert {"register", "grant", "revoke", "list", "prepare", "extra"} <= set(data)
    warned = capsys.readouterr().err
    assert "`nebula keys` is claimed by clashing and the framework: left out" in warned
    assert "`nebula data list` is claimed by clashing and the framework: left out" in warned
    assert "workload plugin gone cannot be loaded" in warned and warned.count("plugin gone") == 1


def test_a_spec_reference_must_name_a_module_and_an_attribute():
    with pytest.raises(ConfigError, match="references 'services.example.stages': each must be 'package.module:attr"):
        workload.Workload(stages={"x": "services.example.stages"})


def test_the_default_demo_is_the_one_marked_or_the_only_one():
    def demo(default=False):
        return Demo(summary="", run=lambda args: 0, job=Path("job.toml"), default=default)
    assert default_demo({"a": demo(), "b": demo(default=True)}) == "b"
    assert default_demo({"a": demo()}) == "a"
    assert default_demo({"a": demo(), "b": demo()}) is None  # then `nebula demo` asks for a name


def test_every_installed_scenario_has_every_hook_of_its_kind():
    for name in scenario_names():
        scenario = load_scenario(name)
        assert all(hasattr(scenario, hook) for hook in hooks(kind_of(scenario)))


def test_the_lab_calls_no_scenario_hook_its_protocols_do_not_declare():
    """Every `scenario.X` and `load_scenario(...).X` in the lab is declared by a protocol of scenarios.py."""
    declared = set().union(*(hooks(kind) for kind in (Scenario, OwnBenchmark, TimeToLoss, TorchPeer, DdpPeer)))
    used = {}
    for path in (ROOT / "nebula_lab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                    isinstance(node.value, ast.Name) and node.value.id == "scenario"
                    or isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "load_scenario"):
                used.setdefault(node.attr, path.name)
    # the scan sees the calls
    assert {"speed_job", "quality", "sentence_stats", "bench", "job", "eval_curve", "peer_module"} <= set(used)
    assert set(used) <= declared, {hook: where for hook, where in used.items() if hook not in declared}
