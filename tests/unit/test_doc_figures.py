"""The figures README.md, docs/codecs.md and docs/transport.md state, computed again: from the code (ratios,
meta and envelope sizes, deflate's bytes per token, configuration defaults), or from the benchmark tables
the same documents record (the prose must quote its own table). A figure a document states and no code or
table produces does not belong there."""
from __future__ import annotations

import dataclasses
import re
import zlib
from pathlib import Path

import pytest
import torch
import zmq

from nebula.codecs import pack
from nebula.gateway.admission import STORE_RECHECK
from nebula.gateway.peers import redial_delay
from nebula.security.audit import DEFAULT_FULL_RECORDS, DEFAULT_SUMMARY_INTERVAL
from nebula.site.config import _GatewayTable
from nebula.transport.config import ChannelConfig
from nebula.transport.sockets import HARD_FRAME_LIMIT, tune
from tests.support.codecs import token_ids
from tests.support.threads import one_thread
from tests.support.wire_doc import envelope_sizes

ROOT = Path(__file__).resolve().parents[2]


def text(name: str) -> str:
    """The document with its whitespace runs made single spaces: figures may wrap across lines."""
    return " ".join((ROOT / name).read_text().split())


def bench_table(name: str) -> dict[tuple[str, ...], list[str]]:
    """docs/codecs.md's recorded `nebula bench codecs` table: (tensor, data, codec) -> the other cells."""
    rows = {}
    for line in (ROOT / name).read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[0] in ("activation", "gradient"):
            rows[tuple(cells[:3])] = cells[3:]
    return rows


def test_the_envelope_sizes_in_readme_and_codecs_md_are_the_computed_ones():
    rows = envelope_sizes()
    low, high = min(r["envelope"] for r in rows), max(r["envelope"] for r in rows)
    assert (low, high) == (rows[0]["envelope"], next(r["envelope"] for r in rows
                                                     if r["codec"] == "int8(lowrank(0.2))"))
    share = f"{max(r['of_tensor'] for r in rows):.4f}%"
    readme, codecs = text("docs/results.md"), text("docs/codecs.md")  # README's long rows moved there
    assert f"{low} (`none`) to {high} bytes (`int8(lowrank(0.2))`), at most {share} of the tensor" in readme
    assert f"{low} (`none`) to {high} bytes (`int8(lowrank(0.2))`), at most {share} of the tensor" in codecs
    meta = next(r["meta"] for r in rows if r["codec"] == "int8(lowrank(0.2))")
    assert f"{meta} bytes for `int8(lowrank(0.2))`" in codecs


def test_the_chain_ratios_in_codecs_md_are_the_computed_ones():
    x = torch.randn(8192, 768, generator=torch.Generator().manual_seed(0))  # the activation as a matrix
    with one_thread():  # lowrank has svd's layout and k, at a fraction of the time
        payloads = {spec: pack("x", "activation", x, spec)
                    for spec in ("lowrank(0.2)", "fp16(lowrank(0.2))", "int8(lowrank(0.2))")}
    ratio = {spec: payload.wire_bytes / (x.numel() * 4) for spec, payload in payloads.items()}
    k = payloads["lowrank(0.2)"].parts[0].shape[1]
    codecs = text("docs/codecs.md")
    assert f"at r = 0.2, k = {k}, ratio {ratio['fp16(lowrank(0.2))']:.3f}" in codecs
    assert f"(`svd(0.2)` alone: {ratio['lowrank(0.2)']:.3f}" in codecs
    assert f"`int8(lowrank(0.2))` on the same tensor: {ratio['int8(lowrank(0.2))']:.4f}" in codecs
    table = bench_table("docs/codecs.md")
    assert table[("activation", "lowrank", "int8(lowrank(0.2))")][0] == f"{ratio['int8(lowrank(0.2))']:.4f}"


def test_the_deflate_figures_in_codecs_md_are_the_computed_ones():
    ids = token_ids()
    per = {spec: pack("ids", "tokens", ids, spec).wire_bytes / ids.numel()
           for spec in ("deflate", "deflate(level=1)", "deflate(level=9)")}
    as_int64 = pack("ids", "tokens", ids.long(), "deflate").wire_bytes / ids.numel()
    raw_zlib = len(zlib.compress(ids.numpy().tobytes(), 6)) / ids.numel()
    floats = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    float_share = pack("x", "activation", floats, "deflate").wire_bytes / (floats.numel() * 4)
    codecs = text("docs/codecs.md")
    assert f"{per['deflate']:.2f} bytes per element (4 raw; zlib of the raw bytes: {raw_zlib:.2f})" in codecs
    assert f"{as_int64:.2f}" == f"{per['deflate']:.2f}" and "the same as int64 (8 raw)" in codecs
    assert f"levels 1 and 9 give {per['deflate(level=1)']:.2f} and {per['deflate(level=9)']:.2f}" in codecs
    assert f"data-dependent: {per['deflate']:.2f}N for int32 token ids" in codecs
    assert f"Gaussian float32 (16, 128): {float_share:.2f} of the bytes" in codecs
    def varint_bytes(token: int) -> int:
        return len(zlib.decompress(pack("i", "t", torch.tensor([token]), "deflate").parts[0].numpy().tobytes()))

    assert [varint_bytes(t) for t in (63, 64, 8191, 8192)] == [1, 2, 2, 3]
    assert "an id below 64 is one byte, below 8192 two" in codecs


def test_the_fp16_scale_threshold_in_codecs_md():
    threshold = 127 * 2.0 ** -25
    assert float(torch.tensor(threshold * 1.01 / 127).half()) > 0 == float(torch.tensor(threshold / 127).half())
    assert f"127 × 2^-25 ≈ {threshold:.1e}".replace("e-06", "e-6") in text("docs/codecs.md")


def test_the_prose_of_codecs_md_and_readme_quotes_the_recorded_benchmark():
    table = bench_table("docs/codecs.md")
    int8 = table[("activation", "lowrank", "int8")]
    bf16 = table[("activation", "lowrank", "int8(scale=bf16)")]
    lowrank, svd = table[("activation", "lowrank", "lowrank(0.2)")], table[("activation", "lowrank", "svd(0.2)")]
    enc, dec = float(int8[2]), float(int8[3])
    codecs, readme = text("docs/codecs.md"), text("docs/results.md")
    assert f"relative error {int8[1]} at {int8[0]} of the bytes" in codecs
    assert f"{enc} + {dec} = {enc + dec:.1f} ms" in codecs and f"activation in {enc} ms" in codecs
    assert f"for {float(int8[0]) - float(bf16[0]):.3f} more of the bytes" in codecs
    speedup, total = float(svd[2]) / float(lowrank[2]), (float(svd[2]) + float(svd[3])) / (float(lowrank[2]) +
                                                                                         float(lowrank[3]))
    assert (f"encodes in {float(lowrank[2]):.0f} ms against exact `svd(0.2)`'s {float(svd[2]):.0f} ms "
            f"({speedup:.1f}x; encode + decode {float(lowrank[2]) + float(lowrank[3]):.0f} vs "
            f"{float(svd[2]) + float(svd[3]):.0f} ms, {total:.1f}x) at "
            f"{float(lowrank[1]) / float(svd[1]):.4f}x its error") in codecs
    assert (f"error {float(int8[1]):.4f} at {float(int8[0]):.3f} of the bytes, encode + decode "
            f"{enc + dec:.1f} ms") in readme
    assert (f"{speedup:.1f}x faster encode ({float(lowrank[2]):.0f} vs {float(svd[2]):.0f} ms) at "
            f"{float(lowrank[1]) / float(svd[1]):.4f}x the error") in readme


def test_the_defaults_docs_transport_md_states_are_the_codes():
    doc = (ROOT / "docs" / "transport.md").read_text()
    block = doc[doc.index("[gateway]\ninternal"):doc.index("[peers.b]")]
    defaults = {f.name: f.default for f in dataclasses.fields(_GatewayTable)}
    stated = dict(re.findall(r"^# (\w+) += (\d+)", block, re.M))
    assert len(stated) >= 12 and {k: float(v) for k, v in stated.items()} == {k: float(defaults[k]) for k in stated}
    channel = {f.name: f.default for f in dataclasses.fields(ChannelConfig)}
    units = {"": 1, " MiB": 1 << 20, " s": 1}
    for name, value, unit in re.findall(r"`(\w+)` \((\d+)( MiB| s)?\)", doc):
        assert channel[name] == int(value) * units[unit], name
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        tune(sock, hwm=10)
        heartbeat = (sock.heartbeat_ivl / 1000, sock.heartbeat_timeout / 1000)
        assert sock.maxmsgsize == HARD_FRAME_LIMIT == (2 << 30) - 1
        reconnect = (sock.reconnect_ivl, sock.reconnect_ivl_max / 1000)
    finally:
        sock.close(linger=0)
    flat = " ".join(doc.split())
    assert f"ZMTP heartbeats ({heartbeat[0]:.0f} s / {heartbeat[1]:.0f} s), `maxmsgsize` 2 GiB − 1" in flat
    assert f"retried by libzmq itself, every {reconnect[0]} ms growing to {reconnect[1]:g} s" in flat
    redials = ", ".join(f"{redial_delay(n):g}" for n in (1, 2, 3))  # a refused link (nebula/gateway/peers.py)
    assert f"after {redials}, then every {redial_delay(99):g} s" in flat and redial_delay(4) == redial_delay(99)
    assert STORE_RECHECK == 1.0 and "re-reading the store at most once a second" in flat
    assert f"the first {DEFAULT_FULL_RECORDS} in each {DEFAULT_SUMMARY_INTERVAL:.0f} s" in flat


def test_the_prose_of_docs_transport_md_quotes_its_table():
    doc = text("docs/transport.md")
    rows = {m[0]: m[1:] for m in re.findall(r"\| ([\w-]+) \([^|]*\) \| (\d*) \| (\d+)[^|]* \| ([^|]*) \|", doc)}
    plain, direct, gateways = rows["zmq-plain"], rows["curve-direct"], rows["curve-gateways"]
    shares = sorted(round(100 * float(direct[i]) / float(plain[i]), 1) for i in (0, 1))
    assert f"{shares[0]}–{shares[1]}% of plain" in doc and f"{direct[2].split(' / ')[1]}" == f"{shares[0]}%"
    assert f"measured {direct[1]} MB/s for 25 MB messages vs {plain[1]} MB/s plain, i.e. " \
           f"{float(plain[1]) / float(direct[1]):.1f}x" in doc
    assert f"({gateways[1]} of {direct[1]} MB/s, {100 * float(gateways[1]) / float(direct[1]):.0f}%)" in doc
    assert f"25,165,824 × 8 bits / 60 Mbit/s = {25165824 * 8 / 60e6:.1f} s" in doc


@pytest.mark.parametrize("name", ["README.md", "docs/results.md", "docs/codecs.md", "docs/transport.md"])
def test_the_retired_figures_are_gone(name):
    """The figures issue 14 found wrong or produced by nothing."""
    doc = text(name)
    for stale in ("about 160 bytes", "234 bytes", "~100 bytes", "0.0565", "< 0.001%", "~60 bytes", "~20–30%",
                  "35 ms", "1.67 bytes", "once in 130 calls", "3000 fuzzed", "120-250", "hivemind's blockwise",
                  "one run in five", "4 MiB buffers"):
        assert stale not in doc, stale
