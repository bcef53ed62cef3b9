"""`delta` on a link: the receiver's cache per (link direction, tensor), the meter, and a resume that
empties both ends (docs/codecs.md, State; docs/protocol.md §3.7)."""
import io
import json

import pytest
import torch

from nebula.errors import CodecError, ConfigError
from nebula.runtime.compression import LinkCodecs

TABLE = {"forward": "delta(int8)", "backward": "ef(int8)"}
IDS = torch.tensor([5, 6, 7], dtype=torch.int64)


def activation(seed: int) -> torch.Tensor:
    base = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    return base + 0.01 * seed * torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(seed))


def test_forward_deltas_decode_at_the_other_end_and_are_metered(tmp_path):
    src = LinkCodecs.from_table(TABLE, "a->b", meter_path=tmp_path / "meter.jsonl")
    dst = LinkCodecs.from_table(TABLE, "a->b")
    for step in (1, 2, 3):
        x = activation(step)
        y = dst.unpack(src.pack("forward", "h", x, step, ids=IDS))
        assert float((y - x).norm() / x.norm()) < (0.007 if step == 1 else 0.001)
        grad = src.unpack(dst.pack("backward", "h", x, step))  # gradients: ef(int8), no ids needed
        assert grad.shape == x.shape
    assert src.cache_stats()["send a->b:forward/h"] == dst.cache_stats()["recv a->b:forward/h"] == {
        "hits": 6, "misses": 3, "evictions": 0, "entries": 3, "bytes": 3 * 8 * 64 * 4, "cap_bytes": 1 << 30,
        "spilled": 0, "read_back": 0, "ram_bytes": 3 * 8 * 64 * 4, "ram_cap_bytes": 1 << 30, "disk_bytes": 0,
        "disk_file_bytes": 0}
    src.meter.close()
    lines = [json.loads(line) for line in (tmp_path / "meter.jsonl").read_text().splitlines()]
    assert [line["cache"]["hits"] for line in lines if line["dir"] == "forward"] == [0, 3, 6]


def test_gradients_without_ids_are_refused_with_a_hint():
    with pytest.raises(ConfigError, match="example ids"):  # when the job is read, not at the first send
        LinkCodecs.from_table({"backward": "delta(int8)"}, "a->b")
    link = LinkCodecs.from_table({"forward": "delta(int8)"}, "a->b")
    with pytest.raises(CodecError, match="example ids"):  # a forward tensor sent without ids
        link.pack("forward", "h", activation(1), 1)


def test_a_resume_empties_both_ends_and_the_next_visit_goes_direct():
    src, dst = LinkCodecs.from_table(TABLE, "a->b"), LinkCodecs.from_table(TABLE, "a->b")
    dst.unpack(src.pack("forward", "h", activation(1), 1, ids=IDS))
    src.pack("backward", "g", activation(1), 1)  # ef's residual: checkpointed as before
    buffer = io.BytesIO()
    torch.save({"src": src.state_dict(), "dst": dst.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # no cache objects inside
    assert [slot[:2] for slot in saved["src"]["slots"]] == [["a->b:backward", "g"]]
    src.pack("forward", "h", activation(2), 2, ids=IDS)  # in flight when a peer crashed: never decoded
    src.load_state_dict(saved["src"])
    dst.load_state_dict(saved["dst"])
    payload = src.pack("forward", "h", activation(3), 2, ids=IDS)
    assert payload.parts[1].tolist() == [0, 0, 0]
    y = dst.unpack(payload)
    assert float((y - activation(3)).norm() / activation(3).norm()) < 0.007
    assert dst.cache_stats()["recv a->b:forward/h"]["misses"] == 3
