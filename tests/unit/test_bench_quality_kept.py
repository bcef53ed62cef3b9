"""`bench wan --quality` keeps a finished run only for the very job it trained: the same job trains
once, another one (steps, seed, evaluation...) trains again. tests/e2e/test_bench_quality.py runs the
kept case through real sites; this is the decision itself, on the files a finished run leaves (and
--eval-uncompressed's refusal of a run whose final checkpoint is gone)."""
import copy
import json

import pytest

from nebula.errors import StageError
from nebula.runtime.job_file import job_text
from nebula_lab.bench.wan import sites_job
from nebula_lab.bench.wan_quality import finished, score_uncompressed

JOB = {"job": {"name": "q", "data": "data"}, "train": {"steps": 2, "seed": 1, "eval_sentences": 8},
       "bench": {"forward": "none", "backward": "none"}}
ROW = {"row": {"bleu_valid": 10.5, "bleu_test": 9.75, "steps": 2}, "curve": [[1, 4.5], [2, 4.25]]}


def finished_run(run):
    """What train_and_score leaves: the job as the sites read it (no [bench]) and the scored row (JOB
    stands for a job: only its text is compared, so it is written as write_job_file would, unchecked)."""
    run.mkdir()
    (run / "job.toml").write_text(job_text(sites_job(JOB)))
    (run / "row.json").write_text(json.dumps(ROW))
    return run


def test_the_same_job_is_kept_with_its_row_and_curve(tmp_path, capsys):
    run = finished_run(tmp_path / "run")
    assert finished(run, copy.deepcopy(JOB)) == (ROW["row"], ROW["curve"])
    assert "kept" in capsys.readouterr().err


def test_a_job_that_differs_in_anything_the_sites_read_trains_again(tmp_path, capsys):
    run = finished_run(tmp_path / "run")
    for section, key, value in (("train", "eval_sentences", 4), ("train", "seed", 2), ("train", "steps", 3)):
        other = copy.deepcopy(JOB)
        other[section][key] = value
        assert finished(run, other) is None, key
    assert capsys.readouterr().err.count("trained another job") == 3


def test_the_bench_section_alone_does_not_count_and_an_unscored_run_is_not_finished(tmp_path):
    run = finished_run(tmp_path / "run")
    relabelled = copy.deepcopy(JOB)
    relabelled["bench"]["forward"] = "fp16"  # [bench] is the bench's own bookkeeping, not the job the sites ran
    assert finished(run, relabelled) == (ROW["row"], ROW["curve"])
    (run / "row.json").unlink()  # killed before it was scored
    assert finished(run, JOB) is None


def test_a_run_without_its_final_checkpoint_is_not_scored_uncompressed_and_says_why(tmp_path):
    run = finished_run(tmp_path / "run")
    lossy = copy.deepcopy(JOB) | {"stages": {"encoder": {}, "decoder": {}},
                                  "links": [{"from": "encoder", "to": "decoder", "compression": {"forward": "int8"}}]}
    (run / "encoder" / "checkpoints").mkdir(parents=True)
    with pytest.raises(StageError, match="has no checkpoint encoder/checkpoints/step-00000002.pt to score"):
        score_uncompressed(run, lossy, scenario=None)
    assert not (run / "uncompressed" / "scored").exists()
