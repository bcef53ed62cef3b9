"""Raw data never crosses a site boundary (issue 11, deliverable 7): a real two-site ABNet job whose
encoder at site a reads a copy of the source side with a marker phrase at the start of every
sentence, while each site's gateway records every frame it sends to the other site in plaintext,
just above CURVE (tests/e2e/recording_gateway.py). Nothing site a sent may hold a line of a data
file that its stage reads (as UTF-8 or as JSON writes it), the marker, or the marker's token ids
(the tokenizer's or the model's cut vocabulary, as int16, int32 or int64): only hidden states,
masks, example-id hashes and control messages go. The same holds for site b's target side going
back to a, but for a known leak (the last test)."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from nebula.runtime.job import load_job
from nebula.site.builder import local_sites
from nebula.site.local import local_services
from nebula.site.supervisor import Supervisor
from nebula.wire import Kind, parse_envelope
from tests.support.recording_gateway import EXTERNAL, PEER, read_record
from tests.support.sites import E2E, JOB_TIMEOUT, write_job

MARKER = "Xylobrantic quendifor marzipelt"  # in no corpus: on the wire, it can only come from site a's text
SOURCE = E2E / "data" / "es-en"
SPLITS = ("train", "valid", "test")
SIDES = {"a": "src", "b": "tgt"}  # the side of the parallel data each site's stage reads (with the ids)
MIN_LINE = 12  # bytes: shorter lines ("Instalados:") could occur by chance
STEPS = 2
Messages = list[tuple[int, list[bytes]]]  # tests.support.recording_gateway.read_record's


class Crossing(NamedTuple):
    data: Path  # the job's data directory (both sites read it, each its own side)
    sent: dict[str, Messages]  # site -> every message its gateway sent to the other site


def marked_copy(dest: Path) -> Path:
    """The tiny corpus with MARKER at the start of every source sentence (where max_len keeps it)."""
    shutil.copytree(SOURCE, dest)
    for split in SPLITS:
        path = dest / f"{split}.src"
        lines = path.read_text(encoding="utf-8").split("\n")[:-1]
        path.write_text("".join(f"{MARKER} {line}\n" for line in lines), encoding="utf-8")
    return dest


def run_job(run: Path, job_file: Path, records: dict[str, Path]) -> None:
    """The job's sites as nebula.site.local.start_sites builds and starts them, but each gateway records
    what it sends to records[site]; no restarts: any failure fails the test."""
    job = load_job(job_file)
    paths = local_sites(run, job.sites, [stage.address for stage in job.stages.values()], run=run, job=job_file)
    with Supervisor() as group:
        for site, path in paths.items():
            for spec in local_services(site, path, restart=False):
                if spec.name == f"gateway-{site}":
                    spec = dataclasses.replace(spec, argv=(sys.executable, "-m", "tests.support.recording_gateway",
                                                           str(records[site]), str(path)))
                group.start(spec)
        # poll() raises StageError with the log's tail if a service fails
        group.run(lambda: all(group.services[name].finished() for name in job.stages), timeout=JOB_TIMEOUT,
                  what="the job to finish")


@pytest.fixture(scope="module")
def crossing(tmp_path_factory) -> Crossing:
    """One job with the marked data, run once for every test here (about 10 s)."""
    root = tmp_path_factory.mktemp("data-stays")
    data = marked_copy(root / "es-en")
    job_file = write_job(root, {f'data = "{SOURCE}"': f'data = "{data}"', "steps = 8": f"steps = {STEPS}"})
    records = {site: root / f"sent-by-{site}.bin" for site in SIDES}
    run_job(root / "run", job_file, records)
    return Crossing(data, {site: read_record(path) for site, path in records.items()})


def envelopes(messages: Messages) -> list:
    """The envelope of each message (after the routing id on the external ROUTER)."""
    return [parse_envelope(frames[1] if socket == EXTERNAL else frames[0]) for socket, frames in messages]


def text_needles(data: Path, site: str) -> dict[bytes, str]:
    """Every line of the data files `site`'s stage reads, of MIN_LINE bytes or more, as UTF-8 and as
    JSON (a CONTROL body's encoding, which escapes non-ASCII), and the marker -> where it comes from."""
    needles = {MARKER.encode(): "the marker"} if site == "a" else {}
    for name in [f"{split}.{ext}" for split in SPLITS for ext in (SIDES[site], "ids")]:
        for k, line in enumerate((data / name).read_text(encoding="utf-8").split("\n")):
            forms = {json.dumps(line)[1:-1].encode(): " (as JSON)", line.encode(): ""}  # one if ASCII
            needles.update({form: f"{name} line {k + 1}{how}" for form, how in forms.items()
                            if len(form) >= MIN_LINE})
    return needles


def token_needles(data: Path) -> dict[bytes, str]:
    """The marker's token ids as the encoder computes them: the tokenizer's and the model's cut
    vocabulary's (built from the same data), as every integer dtype they fit."""
    from services.abnet.sides import TokenizedSide
    from services.models.xlmr_e5 import load_e5_small

    pre = load_e5_small()
    side = TokenizedSide(str(data), "src", pre, max_len=24, limit=None)  # the tiny job's encoder options
    old = torch.tensor(pre.tokenizer.encode(MARKER, add_special_tokens=False).ids)  # (T,)
    new = side.vmap.to_new(old)
    row = side.vmap.to_new(torch.tensor(side.splits["train"]["rows"][0]))  # what the encoder embeds
    assert new.numpy().tobytes() in row.numpy().tobytes(), "the marker's ids are not in the encoder's row"
    needles = {}
    for space, ids in (("tokenizer", old), ("cut vocabulary", new)):
        for dtype in (torch.int16, torch.int32, torch.int64):
            if int(ids.max()) <= torch.iinfo(dtype).max:
                needles[ids.to(dtype).numpy().tobytes()] = f"the marker's {space} ids as {dtype}"
    return needles


def found(messages: Messages, needles: dict[bytes, str]) -> list[str]:
    """Where each needle occurs in any frame (envelope with its CONTROL body, or payload)."""
    hits = []
    for m, ((_, frames), env) in enumerate(zip(messages, envelopes(messages))):
        for i, frame in enumerate(frames):
            hits += [f"{what} in frame {i} of message {m} ({Kind(env.kind).name} {env.topic!r})"
                     for needle, what in needles.items() if needle in frame]
    return hits


def sent_by_stages(messages: Messages) -> dict[tuple[Kind, str], list[int]]:
    """What the stages sent through the gateway to the peer: (kind, topic's head) -> frame count of each."""
    kinds: dict[tuple[Kind, str], list[int]] = {}
    for env, (socket, frames) in zip(envelopes(messages), messages):
        if socket == PEER:
            kinds.setdefault((Kind(env.kind), env.topic.split(":")[0]), []).append(len(frames))
    return kinds


@pytest.mark.parametrize("site,peer,data_topic", [("a", "b", "fwd"), ("b", "a", "bwd")])
def test_each_site_sent_tensors_and_control_to_the_other(crossing, site, peer, data_topic):
    """The checks below have something to look at: every training micro-batch's tensors (hidden
    states from a, their gradients from b), control messages and ACKs went through the recorder."""
    messages = crossing.sent[site]
    kinds = sent_by_stages(messages)
    frame_counts = kinds[(Kind.TENSORS, data_topic)]
    assert len(frame_counts) >= STEPS * 2  # the tiny job's micro_batches = 2
    assert all(n >= 3 for n in frame_counts), "TENSORS without their payload frames"
    assert {Kind.CONTROL, Kind.ACK} <= {kind for kind, _ in kinds}
    routed = {(env.src.split("/")[0], env.dst.split("/")[0]) for env in envelopes(messages)}
    assert routed == {(site, peer)}


def test_no_line_of_site_a_data_nor_the_marker_crosses_to_b(crossing):
    messages = crossing.sent["a"]
    assert (Kind.TENSORS, "infer") in sent_by_stages(messages)  # the test set's hidden states went too
    needles = text_needles(crossing.data, "a")
    assert len(needles) > 600  # 320 source lines and 320 ids, some also in JSON's form
    leaks = found(messages, needles)
    assert not leaks, f"site a sent its data to site b: {leaks[:10]}"


def test_no_token_ids_of_the_marker_cross_to_b(crossing):
    leaks = found(crossing.sent["a"], token_needles(crossing.data))
    assert not leaks, f"site a sent token ids of its data to site b: {leaks[:10]}"


def test_no_line_of_site_b_data_crosses_to_a(crossing):
    leaks = found(crossing.sent["b"], text_needles(crossing.data, "b"))
    assert not leaks, f"site b sent its data to site a: {leaks[:10]}"
