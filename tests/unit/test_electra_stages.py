"""ELECTRA-Cloud's stages (services/electra/stages.py) with the real tokenizer, the shared vocabulary and tiny
real models on the tiny corpora (copied into tmp_path: the vocabulary is cached beside them).

- The discriminator turns whatever bad ids reach it into a DataError that names the cause (the runtime
  sends it to the generator), never an IndexError or RuntimeError from deep inside torch.
- `ragged` packs masked positions and their values into (B, K) and back.
- The generator's masks and samples depend on (seed, step, micro-batch), the weights and torch's RNG
  (dropout; a checkpoint restores it), not on what ran before: a resumed step is the same step. Every
  row has a masked position, and no sample is a special id (a sampled <pad> would read as padding).
- `sample` draws softmax(scores) exactly (frequencies over 200,000 draws), never a category at -inf, and the
  same draws from the same generator seed.
- A one-site run records the link's bytes per token in the generator's metrics: about 2 with the
  shipped `deflate`, several times that with `none`.
- ranks = "auto" measures n in [1, max_ranks], within [0.9 r, r / 0.85] of the measured ratio r, and
  scales the step by it; a discriminator on a slow emulated device needs every rank it may have.
- An emulated device takes its `device_time` per micro-batch, and one faster than the model that runs
  is a ConfigError naming the key."""
import math
import os
import time

import pytest
import torch

from nebula.errors import ConfigError, DataError
from nebula.runtime.autoranks import resolve, scale_step
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.job import TrainConfig, load_job
from nebula.runtime.metrics import read_records
from nebula.runtime.onesite import run_one_site
from nebula.runtime.order import id_hashes
from nebula.runtime.service import build_stage
from nebula.runtime.stage import Batch
from services.electra.calibrate import auto_subs
from services.electra.stages import NO_POSITION, SAME, ragged, sample
from tests.support.electra import electra_job

LINK = "generator->disc:forward"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return load_job(electra_job(tmp_path_factory.mktemp("electra")))


@pytest.fixture(scope="module")
def generator(job, tmp_path_factory):
    return build_stage(job, "generator", tmp_path_factory.mktemp("generator"), quiet=True)


@pytest.fixture(scope="module")
def disc(job, tmp_path_factory):
    return build_stage(job, "disc", tmp_path_factory.mktemp("disc"), quiet=True)


def batch(gen, step: int, micro_batch: int, indices: list[int]) -> Batch:
    ids = gen.examples("train")
    return Batch("train", step, micro_batch, ids=id_hashes([ids[i] for i in indices]), indices=indices)


def varied(gen, n: int = 8) -> list[int]:
    """n training sequences from the shortest to the longest: the batch has padding."""
    rows = gen.corpus.splits["train"].rows
    by_length = sorted(range(len(rows)), key=lambda i: (len(rows[i]), i))
    return [by_length[k * (len(rows) - 1) // (n - 1)] for k in range(n)]


@pytest.fixture(scope="module")
def sent(generator):
    """What the generator sends for one micro-batch, and the ids it corrupted."""
    indices = varied(generator)
    out = generator.forward(batch(generator, 3, 1, indices), {})
    ids = generator.corpus.splits["train"].batch(indices, generator.specials.pad)
    return {k: v.detach() for k, v in out.tensors.items()}, ids


def test_discriminator_reads_back_what_the_generator_sent(sent, disc):
    inputs, ids = sent
    assert {k: v.dtype for k, v in inputs.items()} == dict.fromkeys(("tokens", "positions", "originals"), torch.int32)
    tokens, at, originals = (t.cpu() for t in disc.check(inputs, "here"))  # on the stage's device: cuda too
    assert torch.equal(originals, ids)  # the corrupted sequences with every original put back
    assert int(at.sum()) == int((inputs["positions"] != NO_POSITION).sum()) > 0
    assert not (tokens != ids)[~at].any()  # only masked positions were changed
    positions = inputs["positions"].long()
    used = positions != NO_POSITION
    row = torch.arange(len(ids))[:, None].expand_as(positions)
    kept = tokens[row[used], positions[used]] == ids[row[used], positions[used]]
    assert torch.equal(kept, inputs["originals"][used] == SAME)  # 0: the generator sampled the original


def _row_with(positions: torch.Tensor, masked: int) -> int:
    rows = ((positions != NO_POSITION).sum(1) >= masked).nonzero()
    assert len(rows), f"no row with {masked} masked positions in the test batch"
    return int(rows[0])


def _padded_row(tokens: torch.Tensor, pad: int) -> tuple[int, int]:
    rows = (tokens[:, -1] == pad).nonzero()
    assert len(rows), "no padded row in the test batch"
    return int(rows[0]), tokens.shape[1] - 1


def _corrupt(case: str, x: dict, vocab: int, pad: int) -> None:
    tokens, positions, originals = x["tokens"], x["positions"], x["originals"]
    width = tokens.shape[1]
    if case == "token past the vocabulary":
        tokens[0, 0] = vocab
    elif case == "negative token":
        tokens[1, 2] = -5
    elif case == "original past the vocabulary":
        originals[0, 0] = vocab + 7  # each row has a masked position: slot 0 is used
    elif case == "position past the sequence":
        positions[0, 0] = width
    elif case == "negative position other than -1":
        positions[0, 0] = -2
    elif case == "position listed twice":
        row = _row_with(positions, 2)
        positions[row, 1] = positions[row, 0]
    elif case == "position in the padding":
        row, column = _padded_row(tokens, pad)
        positions[row, 0] = column
    elif case == "positions and originals of different shapes":
        x["originals"] = originals[:, :-1]
    elif case == "fewer rows of positions than of tokens":
        x["positions"], x["originals"] = positions[:-1], originals[:-1]
    elif case == "tokens without a batch dimension":
        x["tokens"] = tokens[0]
    elif case == "sequences longer than the discriminator's positions":
        x["tokens"] = torch.cat([tokens, torch.full((len(tokens), 40), pad, dtype=tokens.dtype,
                                                     device=tokens.device)], 1)
    else:
        raise AssertionError(case)


REJECTED = {  # case -> what the DataError must say
    "token past the vocabulary": r"1 tokens outside the vocabulary of \d+ ids .*same vocabulary \(vocab_corpora\)",
    "negative token": r"1 tokens outside the vocabulary of \d+ ids \(e\.g\. -5\)",
    "original past the vocabulary": r"1 originals outside the vocabulary of \d+ ids .*vocab_corpora",
    "position past the sequence": r"masked position (\d+) outside sequences of \1 tokens",
    "negative position other than -1": r"masked position -2 outside sequences of \d+ tokens",
    "position listed twice": r"a masked position is listed twice in one sequence",
    "position in the padding": r"a masked position lies in a sequence's padding",
    "positions and originals of different shapes":
        r"tokens \(8, \d+\), positions \(8, (\d+)\) and originals \(8, (?!\1\))\d+\): expected \(B, S\), \(B, K\)",
    "fewer rows of positions than of tokens": r"tokens \(8, \d+\), positions \(7, \d+\) .*expected \(B, S\)",
    "tokens without a batch dimension": r"tokens \(\d+,\), .*expected \(B, S\)",
    "sequences longer than the discriminator's positions":
        r"sequences of \d+ tokens, the discriminator has 32 positions: set the same max_len on every stage",
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_discriminator_check_turns_bad_ids_into_a_data_error(case, sent, disc):
    inputs, _ = sent
    x = {k: v.clone() for k, v in inputs.items()}
    _corrupt(case, x, len(disc.vmap), disc.specials.pad)
    with pytest.raises(DataError, match=r"^step 3 micro-batch 1 on generator->disc: " + REJECTED[case]):
        disc.check(x, "step 3 micro-batch 1 on generator->disc")


def test_ragged_round_trip():
    g = torch.Generator().manual_seed(0)
    at = torch.rand(6, 11, generator=g) < 0.3
    at[2] = False  # a row with nothing masked
    at[4] = True  # and one all masked
    values = torch.randint(1, 1000, (int(at.sum()),), generator=g)
    positions, padded = ragged(at, values)
    counts = at.sum(1)
    assert positions.shape == padded.shape == (6, int(counts.max()))
    used = positions != NO_POSITION
    assert torch.equal(used, torch.arange(positions.shape[1])[None, :] < counts[:, None])  # padding at the end
    row = torch.arange(6)[:, None].expand_as(positions)
    back = torch.zeros_like(at)
    back[row[used], positions[used]] = True
    assert torch.equal(back, at)
    assert torch.equal(padded[used], values)  # row-major: the values in the order of at.nonzero()
    assert (padded[~used] == 0).all()
    assert all(bool((p[:c].diff() > 0).all()) for p, c in zip(positions, counts))  # ascending
    for shape in ((3, 5), (0, 5)):  # nothing masked, no rows
        empty_positions, empty_values = ragged(torch.zeros(shape, dtype=torch.bool), torch.zeros(0, dtype=torch.long))
        assert empty_positions.shape == empty_values.shape == (shape[0], 0)


def test_generator_masks_and_samples_are_a_function_of_seed_step_and_micro_batch(job, generator, tmp_path):
    """A fresh process resuming step 5 (same weights, torch's RNG from the checkpoint) sends what the first
    did, whatever it ran before; the masks do not even depend on torch's RNG."""
    indices = varied(generator)
    torch.manual_seed(11)  # what a checkpoint restores (dropout draws from it)
    first = generator.forward(batch(generator, 5, 1, indices), {}).tensors
    other = build_stage(job, "generator", tmp_path / "resumed", quiet=True)  # the same initial weights
    for step in (1, 2, 9):  # other work first, drawing from torch's RNG
        other.forward(batch(other, step, 0, indices), {})
    torch.rand(1000)
    masks_only = other.forward(batch(other, 5, 1, indices), {}).tensors
    assert torch.equal(masks_only["positions"], first["positions"])
    torch.manual_seed(11)
    again = other.forward(batch(other, 5, 1, indices), {}).tensors
    for name in ("tokens", "positions", "originals"):
        assert torch.equal(again[name], first[name]), name
    for step, micro_batch in ((5, 0), (6, 1)):  # another micro-batch or step: other masks
        torch.manual_seed(11)
        assert not torch.equal(generator.forward(batch(generator, step, micro_batch, indices), {}).tensors["positions"],
                               first["positions"])


def test_generator_masks_every_row_and_never_samples_a_special(tmp_path):
    job = load_job(electra_job(tmp_path, {'corpus = "es-en"': 'corpus = "es-en"\nmask_prob = 0.01'}))
    gen = build_stage(job, "generator", tmp_path / "generator", quiet=True)
    highest_special = max(gen.specials.as_list())
    with torch.no_grad():  # a generator that all but always predicts a special: <pad>, <s>, </s>, <unk>, <mask>
        gen.module.lm.bias[:highest_special + 1] = 50.0
    indices = list(range(16))
    out = gen.forward(batch(gen, 1, 0, indices), {}).tensors
    ids = gen.corpus.splits["train"].batch(indices, gen.specials.pad)
    positions, tokens = out["positions"].long().cpu(), out["tokens"].long().cpu()  # cuda where the stage is
    used = positions != NO_POSITION
    assert used[:, 0].all()  # every row has a masked position
    assert (used.sum(1) == 1).sum() >= 8  # most by the at-least-one rule: 1% of ~25 tokens is rarely any
    row = torch.arange(len(tokens))[:, None].expand_as(positions)
    assert (ids[row[used], positions[used]] > highest_special).all()  # only real tokens are masked
    assert (tokens[row[used], positions[used]] > highest_special).all()  # and replaced by real tokens


def generator_records(run) -> list[dict]:
    return read_records(run / "generator" / "metrics.jsonl", "step")


def test_one_site_run_reports_bytes_per_token_deflate_against_none(tmp_path):
    """One message of 16 sequences a step, as the shipped jobs (4 zlib streams and 16 id hashes per message
    are the fixed part that a smaller message pays more for); no dropout, so the bytes are the same in every
    run (the two stages' threads share torch's RNG)."""
    shape = {"steps = 8": "steps = 3", "batch_size = 8": "batch_size = 16", "micro_batches = 2": "micro_batches = 1",
             "ffn = 64}": "ffn = 64, dropout = 0.0}"}
    per_token = {}
    for codec in ("deflate", "none"):
        job = load_job(electra_job(tmp_path / codec, {**shape, 'forward = "deflate"': f'forward = "{codec}"'}))
        run_one_site(job, tmp_path / codec / "run", quiet=True, timeout=120)
        records = generator_records(tmp_path / codec / "run")
        assert [r["step"] for r in records] == [1, 2, 3]
        for r in records:
            assert r["stats"]["sequences"] == 16 and 0 < r["stats"]["masked"] < r["stats"]["tokens"]
            # every step's record: the bytes of that step's messages (all of them, none of the next step's)
            assert r["bytes_per_token"][LINK] == pytest.approx(r["sent"][LINK] / r["stats"]["tokens"], abs=1e-4)
            assert math.isfinite(r["loss"])
        assert all(math.isfinite(r["loss"]) for r in read_records(tmp_path / codec / "run" / "disc" / "metrics.jsonl"))
        per_token[codec] = [r["bytes_per_token"][LINK] for r in records]
    assert max(per_token["deflate"]) <= 2.5, per_token
    assert min(per_token["none"]) > 2.5 * max(per_token["deflate"]), per_token  # int32 ids, int64 hashes


AUTO = {'impl = "electra-discriminator"': 'impl = "electra-discriminator"\nranks = "auto"\nmax_ranks = 3'}


def test_auto_ranks_resolve_to_a_measured_n_that_scales_the_step(tmp_path):
    out, evidence = resolve(electra_job(tmp_path, AUTO), tmp_path / "resolved.toml", quiet=True)
    n = evidence["disc"]["ranks"]
    assert 1 <= n <= 3
    assert evidence["disc"]["most"] == 3 and evidence["disc"]["t_sub_s"] > 0
    assert set(evidence["disc"]["t_generator_s"]) == {"generator"}
    resolved = load_job(out)
    assert resolved.stage("disc").ranks == n and not resolved.stage("disc").auto_ranks
    assert (resolved.train.batch_size, resolved.train.micro_batches) == (8 * n, 2 * n)  # n x one rank's step
    assert resolved.data == load_job(tmp_path / "job.toml").data


def test_an_omitted_step_size_scales_from_the_jobs_own_defaults():
    """micro_batches left out reads as TrainConfig's 4, not 1: n = 2 gave 2 micro-batches, fewer than one rank's."""
    train = {}
    scale_step(train, 2)
    assert train == {"batch_size": 2 * TrainConfig.batch_size, "micro_batches": 2 * TrainConfig.micro_batches} \
        == {"batch_size": 64, "micro_batches": 8}


def test_a_slow_emulated_device_gets_every_rank_it_may_have(tmp_path):
    slow = {'impl = "electra-discriminator"': 'impl = "electra-discriminator"\nranks = "auto"\nmax_ranks = 3\n'
                                              'device_time = 0.5'}
    out, evidence = resolve(electra_job(tmp_path, slow), tmp_path / "resolved.toml", quiet=True)
    assert evidence["disc"]["ranks"] == 3 and evidence["disc"]["t_sub_s"] >= 0.5, evidence
    resolved = load_job(out)
    assert resolved.stage("disc").ranks == 3 and resolved.train.batch_size == 24 and resolved.train.micro_batches == 6


def test_auto_ranks_measure_g_and_d_pinned_to_different_cores(tmp_path):
    """Table 4's job: G on a core of its own, D's ranks on the others. Building D pins the calibrating
    process to D's cores; G must still be built on its own (it was refused: "may run on cores [1] only")."""
    cores = sorted(os.sched_getaffinity(0))
    g_core, d_cores = cores[:1], cores[1:] or cores[:1]
    pinned = {'corpus = "es-en"': f'corpus = "es-en"\ncpus = {g_core}',
              'impl = "electra-discriminator"': f'impl = "electra-discriminator"\nranks = "auto"\nmax_ranks = 2\n'
                                                f'cpus = {d_cores}'}
    out, evidence = resolve(electra_job(tmp_path, pinned), tmp_path / "resolved.toml", quiet=True)
    assert 1 <= evidence["disc"]["ranks"] <= 2
    assert sorted(os.sched_getaffinity(0)) == cores  # the calibration hands this process its cores back


@pytest.mark.parametrize("r, n", [(1.0, 1), (1.2, 1), (2.5, 2), (3.56, 4), (7.9, 9), (14.2, 16), (40.0, 16)])
def test_auto_n_lies_within_0_9_r_and_r_over_0_85_where_an_integer_does(r, n):
    assert auto_subs(0.1, 0.1 * r, 16) == n
    if math.ceil(0.9 * r) <= math.floor(r / 0.85) and r < 16:
        assert 0.9 * r <= n <= r / 0.85 < n + 1  # the band's largest


def micro_batch(disc, inputs) -> float:
    """Wall seconds of one micro-batch's forward and backward at the discriminator."""
    started = time.perf_counter()
    disc.forward(Batch("train", 1, 0, ids=torch.zeros(len(inputs["tokens"]), dtype=torch.long),
                       link="generator->disc"), inputs).loss.backward()
    return time.perf_counter() - started


def test_an_emulated_device_takes_its_time_and_refuses_to_be_faster_than_the_model(tmp_path, sent):
    inputs, _ = sent
    job = load_job(electra_job(tmp_path, {'impl = "electra-discriminator"':
                                          'impl = "electra-discriminator"\ndevice_time = 0.3'}))
    disc = build_stage(job, "disc", tmp_path / "disc", quiet=True)
    assert 0.3 <= micro_batch(disc, inputs) < 0.3 + 0.25  # the stand-in computes in a few ms, then sleeps
    assert 0.3 <= micro_batch(disc, inputs) and disc.clock.waited > 0.1
    too_fast = load_job(electra_job(tmp_path / "fast", {'impl = "electra-discriminator"':
                                                        'impl = "electra-discriminator"\ndevice_time = 1e-6'}))
    disc = build_stage(too_fast, "disc", tmp_path / "fast-disc", quiet=True)
    micro_batch(disc, inputs)  # the first pays for allocations: not judged
    with pytest.raises(ConfigError, match=r"^\[stages\.disc\] device_time = 1e-06 s is less than this stage's real "
                                          r"compute per micro-batch \(0\.\d+ s\)"):
        micro_batch(disc, inputs)


def test_sync_numel_sends_a_larger_d_s_gradient_size_through_the_all_reduce_and_never_applies_it(tmp_path, sent):
    """The runtime all-reduces every trainable gradient (a missing one as zeros): the ballast makes the stand-in's
    all-reduce as large as the paper-proportioned D's, while its optimiser never sees it and a checkpoint loads."""
    job = load_job(electra_job(tmp_path, {'impl = "electra-discriminator"':
                                          'impl = "electra-discriminator"\nsync_numel = 5000'}))
    disc = build_stage(job, "disc", tmp_path / "disc", quiet=True)
    plain = build_stage(load_job(electra_job(tmp_path / "plain")), "disc", tmp_path / "plain-disc", quiet=True)
    weights = disc.trainable()
    assert weights["sync_ballast"].numel() == 5000 and set(weights) - set(plain.trainable()) == {"sync_ballast"}
    stepped = {id(p) for group in disc.optimizer.param_groups for p in group["params"]}
    assert id(weights["sync_ballast"]) not in stepped and len(stepped) == len(weights) - 1
    micro_batch(disc, sent[0])
    assert weights["sync_ballast"].grad is None  # no gradient of its own: the all-reduce sends zeros
    disc.optimizer_step(1)
    assert not weights["sync_ballast"].any()
    disc.load_state_dict(disc.state_dict())


def test_cpus_outside_this_process_s_cores_are_refused(tmp_path):
    job = load_job(electra_job(tmp_path, {'corpus = "es-en"': 'corpus = "es-en"\ncpus = [4096]'}))
    with pytest.raises(ConfigError, match=r"\[stages\.generator\] cpus = \[4096\]: this process may run on cores"):
        build_stage(job, "generator", tmp_path / "generator", quiet=True)


def test_sample_draws_the_softmax_and_never_a_category_at_minus_infinity():
    p = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])  # 0 at both ends and inside: -inf scores
    scores = p.log().expand(200_000, 6).contiguous()
    draws = sample(scores, torch.Generator().manual_seed(5))
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    assert freq[p == 0].sum() == 0
    sd = (p * (1 - p) / len(draws)).sqrt().double()
    assert ((freq - p.double()).abs() <= 5 * sd + 1e-12).all(), freq  # 5 sigma: a wrong sampler misses by far more
    assert torch.equal(draws, sample(scores, torch.Generator().manual_seed(5)))
    one = torch.full((3, 6), float("-inf"))
    one[:, -1] = 0.0  # all the mass on the last category: the top of the search
    assert sample(one, torch.Generator().manual_seed(0)).tolist() == [5, 5, 5]


def test_gamma_zero_computes_no_corrective_lm(tmp_path, sent):
    inputs, _ = sent
    job = load_job(electra_job(tmp_path, {'impl = "electra-discriminator"':
                                          'impl = "electra-discriminator"\nclm_weight = 0.0'}))
    disc = build_stage(job, "disc", tmp_path / "disc", quiet=True)
    out = disc.forward(Batch("train", 1, 0, ids=torch.zeros(len(inputs["tokens"]), dtype=torch.long),
                             link="generator->disc"), inputs)
    out.loss.backward()
    assert out.stats["clm_loss"] == 0 and out.stats["rtd_loss"] > 0
    assert disc.module.clm.dense.weight.grad is None  # the head never ran (Table 4's stand-in relies on it)
    assert disc.module.rtd[0].weight.grad is not None


def test_a_frozen_generator_without_trained_weights_is_refused(tmp_path):
    job = load_job(electra_job(tmp_path, {'corpus = "es-en"': 'corpus = "es-en"\nfrozen = true'}))
    with pytest.raises(ConfigError, match=r'\[stages\.generator\] frozen = true with init = "random"'):
        build_stage(job, "generator", tmp_path / "generator", quiet=True)


def test_a_frozen_generator_teaches_from_its_init_weights_and_never_changes_them(tmp_path):
    """G after 2 steps of training is the teacher; the frozen run's G keeps its weights, computes L_G with no
    graph, saves no weights or optimiser, while D trains; a restore rebuilds G from its init."""
    first = load_job(electra_job(tmp_path / "mlm", {"steps = 8": "steps = 2"}))
    run_one_site(first, tmp_path / "mlm" / "run", quiet=True, timeout=120)
    teacher = tmp_path / "mlm" / "run" / "generator" / "checkpoints" / "step-00000002.pt"
    weights = CheckpointDir(teacher.parent).load(2)["stage"]["weights"]
    job = load_job(electra_job(tmp_path / "kd", {'corpus = "es-en"': f'corpus = "es-en"\nfrozen = true\n'
                                                                      f'init = "{teacher}"'}))
    g = build_stage(job, "generator", tmp_path / "g", quiet=True)
    assert g.optimizer is None and g.trainable() == {}
    assert all(torch.equal(p, weights[k]) for k, p in g.module.named_parameters())
    out = g.forward(batch(g, 1, 0, varied(g)), {})
    assert math.isfinite(float(out.loss)) and not out.loss.requires_grad

    run_one_site(job, tmp_path / "kd" / "run", quiet=True, timeout=120)
    assert len(generator_records(tmp_path / "kd" / "run")) == 8
    assert all(math.isfinite(r["loss"]) for r in generator_records(tmp_path / "kd" / "run"))
    saved = CheckpointDir(tmp_path / "kd" / "run" / "generator" / "checkpoints").load(8)["stage"]
    assert saved["weights"] == {} and "optimizer" not in saved
    g.load_state_dict(saved)  # a restore reads no weights into G: they stay its init's, as rebuilt
    assert all(torch.equal(p, weights[k]) for k, p in g.module.named_parameters())
    d0, d8 = (CheckpointDir(tmp_path / "kd" / "run" / "disc" / "checkpoints").load(s)["stage"]["weights"]
              for s in (0, 8))
    assert any(not torch.equal(d0[k], d8[k]) for k in d0)
