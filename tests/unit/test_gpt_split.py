"""A GPT job whose stage split is not one model fails as a ConfigError naming the stage to fix, before
any stage builds its model (services/gpt/split.py)."""
import pytest

from nebula.errors import ConfigError
from nebula.runtime.job import load_job
from nebula.runtime.service import build_stage
from services.gpt import stages as gpt_stages
from services.gpt.split import check_split
from services.gpt.stages import ROLES
from tests.support.gpt import gpt_job


def chain(*layers):
    """first, mid (mid2, ...), last, holding `layers` in order."""
    names = ["first", *(["mid", "mid2"][:len(layers) - 2]), "last"]
    impls = ["gpt-first", *["gpt-middle"] * (len(layers) - 2), "gpt-last"]
    return tuple(zip(names, impls, layers))


def test_a_split_covering_every_layer_once_passes_in_chain_order(tmp_path):
    job = load_job(gpt_job(tmp_path, chain([0, 1], [1, 3], [3, 4])))
    assert check_split(job, ROLES) == ["first", "mid", "last"]


@pytest.mark.parametrize("layers, stage, says", [
    (([0, 1], [2, 3], [3, 4]), "mid", "layers 1..1 are held by no stage; start it at 1"),
    (([0, 2], [1, 3], [3, 4]), "mid", "layers 1..1 are also held by the stage before it; start it at 2"),
    (([0, 1], [1, 2], [2, 3]), "last", "layers 3..3 are held by no stage"),
    (([1, 2], [2, 3], [3, 4]), "first", "layers 0..0 are held by no stage"),
    (([0, 1], [1, 1], [1, 4]), "mid", "must hold at least one"),
    (([0, 1], [1, 3], [3, 5]), "last", "must hold at least one of the model's layers 0..3"),
])
def test_a_gap_an_overlap_or_a_short_split_names_the_stage(tmp_path, layers, stage, says):
    job = load_job(gpt_job(tmp_path, chain(*layers)))
    with pytest.raises(ConfigError, match=rf"\[stages\.{stage}\]\.layers.*{says}"):
        check_split(job, ROLES)


def test_stages_that_disagree_on_the_model_name_the_one_that_differs(tmp_path):
    path = gpt_job(tmp_path)
    text = path.read_text()
    mid = text.index("[stages.mid]")
    path.write_text(text[:mid] + text[mid:].replace("d_model = 16", "d_model = 32", 1))
    with pytest.raises(ConfigError, match=r"\[stages\.mid\]\.d_model = 32 but \[stages\.first\] has 16"):
        check_split(load_job(path), ROLES)


def test_link_widths_that_differ_name_the_receiving_stage(tmp_path):
    path = gpt_job(tmp_path, bottleneck=4)
    text = path.read_text()
    last = text.index("[stages.last]")
    path.write_text(text[:last] + text[last:].replace("bottleneck = 4", "bottleneck = 8", 1))
    with pytest.raises(ConfigError, match=r"stage last: its link from mid would carry \(B, T, 4\) but last "
                                          r"expects \(B, T, 8\)"):
        check_split(load_job(path), ROLES)


def test_the_stage_fails_before_it_builds_a_model(tmp_path, monkeypatch):
    job = load_job(gpt_job(tmp_path, chain([0, 1], [2, 3], [3, 4])))
    built = []
    monkeypatch.setattr(gpt_stages, "GptPart", lambda *a, **k: built.append(a))  # records a build, if any
    for name in job.stages:
        with pytest.raises(ConfigError, match=r"\[stages\.mid\]\.layers"):
            build_stage(job, name, tmp_path / name, quiet=True)
    assert built == []


def test_a_link_without_gradients_is_refused(tmp_path):
    path = gpt_job(tmp_path)
    path.write_text(path.read_text().replace("backward = true", "backward = false", 1))
    with pytest.raises(ConfigError, match=r"first->mid: backward = true is required"):
        check_split(load_job(path), ROLES)
