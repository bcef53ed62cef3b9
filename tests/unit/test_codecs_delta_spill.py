"""`delta(..., ram=)`: cached rows past `ram` MiB wait on disk, and nothing else changes (docs/codecs.md)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nebula.codecs import CodecState, pack, parse, unpack
from nebula.codecs.delta import MIB
from nebula.errors import ConfigError
from nebula.runtime.compression import LinkCodecs

PLACEMENT = {"spilled", "read_back", "ram_bytes", "ram_cap_bytes", "disk_bytes", "disk_file_bytes"}


def visits(messages: int = 30, width: int = 1024, seed: int = 0):
    """Messages of 6 examples drawn from 24, each padded to its longest sentence (8..64 tokens): rows of
    32-256 KiB, revisited at other lengths, with an id repeated within a message now and then."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(messages):
        ids = torch.randint(0, 24, (6,), generator=gen)
        length = int(torch.randint(8, 65, (), generator=gen))
        x = (ids.float()[:, None, None] + 0.01 * torch.randn(6, length, width, generator=gen))
        yield ids.to(torch.int64), x


def run(spec: str, spill_dir: Path):
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    out = []
    for ids, x in visits():
        payload = pack("h", "activation", x, spec, state=sender, ids=ids, spill_dir=spill_dir)
        out.append((payload.parts, unpack(payload, state=receiver, spill_dir=spill_dir)))
    return out, sender["cache"], receiver["cache"]


@pytest.mark.parametrize("ram", [1, 0])
def test_a_spilled_cache_sends_and_decodes_exactly_what_one_in_memory_does(tmp_path, ram):
    kept, kept_send, _ = run("delta(int8, mb=4)", tmp_path)
    spilled, send, receive = run(f"delta(int8, mb=4, ram={ram})", tmp_path)
    for (parts, y), (kept_parts, kept_y) in zip(spilled, kept):
        assert all(torch.equal(a, b) for a, b in zip(parts, kept_parts)) and torch.equal(y, kept_y)
    stats = send.stats()
    assert stats == receive.stats()  # both ends spill alike, as they evict alike
    assert {k: v for k, v in stats.items() if k not in PLACEMENT} == \
        {k: v for k, v in kept_send.stats().items() if k not in PLACEMENT}
    assert stats["evictions"] > 0 and stats["hits"] > 20  # the 4 MiB cap bites, and bases come back from disk
    assert stats["spilled"] > 0 and stats["read_back"] > 0
    assert stats["ram_bytes"] <= ram * MIB and stats["ram_bytes"] + stats["disk_bytes"] == stats["bytes"]
    assert stats["disk_file_bytes"] <= 4 * MIB + 24 * 4096  # freed blocks are reused: the cap and a block per row


def test_the_spill_file_is_anonymous_in_the_stage_directory_and_gone_with_the_cache(tmp_path):
    link = LinkCodecs.from_table({"forward": "delta(int8, mb=1, ram=0)"}, "a->b", spill_dir=tmp_path / "run")
    ids, x = next(visits())
    link.pack("forward", "h", x, 1, ids=ids)
    stats = link.cache_stats()["send a->b:forward/h"]
    assert stats["disk_bytes"] == stats["bytes"] > 0 and stats["ram_bytes"] == 0
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert any(re.match(rf"{re.escape(str(tmp_path / 'run'))}/\S+ \(deleted\)$", p) for p in held)
    assert list((tmp_path / "run").iterdir()) == []  # nothing to clean up after a crash
    link.load_state_dict(link.state_dict())  # a resume empties the caches; their files go with them
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not any(str(tmp_path / "run") in p for p in held)


FULL_DISK = r"""
import json, logging, resource, signal, sys, torch
from nebula.codecs import CodecState, pack, unpack
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (600 << 10, 600 << 10))  # a disk with room for ~2 rows
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
ids = torch.arange(8, dtype=torch.int64)
for visit in range(3):
    x = torch.randn(8, 64, 1024, generator=torch.Generator().manual_seed(visit))  # 256 KiB rows
    payload = pack("h", "activation", x, "delta(int8, ram=0)", state=sender, ids=ids, spill_dir=sys.argv[1])
    y = unpack(payload, state=receiver, spill_dir=sys.argv[1])
    assert float((y - x).norm() / x.norm()) < 0.01
print("tags", payload.parts[1].tolist())
print("same", sender["cache"].stats() == receiver["cache"].stats())
print(json.dumps(sender["cache"].stats()))
"""


def test_a_full_disk_keeps_rows_in_memory_and_both_ends_in_step(tmp_path):
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("delta cache: cannot spill")]
    assert len(warnings) == 2 and "File too large" in warnings[0]  # once at each end, not once per row
    assert "tags [2, 2, 2, 2, 2, 2, 2, 2]" in lines  # every row still a delta against the last visit
    assert "same True" in lines
    stats = json.loads(lines[-1])
    assert stats["spilled"] >= 2 and stats["disk_bytes"] == 2 * 256 * 1024  # what the disk had room for
    assert stats["ram_bytes"] == 6 * 256 * 1024 > stats["ram_cap_bytes"] == 0


@pytest.mark.parametrize("spec, message", [
    ("delta(int8, ram=2048)", "ram=2048 must be an integer in 0..mb (1024)"),
    ("delta(int8, mb=8, ram=-1)", "ram=-1 must be an integer in 0..mb (8)"),
])
def test_a_ram_share_outside_the_cache_is_refused(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(spec)


def test_ram_is_part_of_the_spec_that_every_message_names():
    assert parse("delta(int8(lowrank(0.1)), mb=8192, ram=1024)").spec == "delta(int8(lowrank(0.1)), mb=8192, ram=1024)"
    assert parse("delta(int8, ram=1024)").spec == "delta(int8)"  # equal to mb, its default: the same codec


def test_the_two_tiers_are_one_lru_whatever_the_sizes_and_the_ram_share(tmp_path):
    """Random puts and takes of rows of random sizes against a one-dict LRU (the cache before spilling):
    the same entries, in the same order of use, with the same rows, after every operation."""
    from collections import OrderedDict

    from nebula.codecs.delta import ENTRY_BYTES, RowCache

    gen = torch.Generator().manual_seed(3)
    for ram in (0, 20_000, 60_000):
        cache, model = RowCache(100_000, ram, tmp_path), OrderedDict()
        for op in range(400):
            key = int(torch.randint(0, 30, (), generator=gen))
            if key in model and op % 3:
                model.move_to_end(key)
                row = cache.get(key)[1]  # as the codec reads a base, then marks it used
                cache.touch(key, row)
                assert torch.equal(row, model[key])
            else:
                row = torch.randn(int(torch.randint(1, 3000, (), generator=gen)), generator=gen)
                model.pop(key, None)
                model[key] = row
                while sum(r.numel() * 4 + ENTRY_BYTES for r in model.values()) > 100_000:
                    model.popitem(last=False)
                cache.put(key, op + 1, row)
            assert cache.state_dict()["ids"].tolist() == list(model) and cache.ram_bytes <= ram  # least recent first
            assert cache.bytes == sum(r.numel() * 4 for r in model.values())
        assert all(torch.equal(cache.get(k)[1], model[k]) for k in model)
        assert cache.stats()["disk_file_bytes"] <= 100_000 + 30 * 4096
