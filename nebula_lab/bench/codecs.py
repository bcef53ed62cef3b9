"""`nebula bench codecs`: bytes, error and speed of every codec on activation- and gradient-shaped tensors.

For each (tensor, data, codec): wire bytes / raw float32 bytes, relative error ||x - x'|| / ||x||,
median encode and decode ms, the envelope frame's bytes (`env B`: what the message adds to the payload),
and the end-to-end time encode + wire + decode at 60 and 170 Mbit/s against sending raw float32 (wire
time = bytes * 8 / rate), all measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

RATES_MBIT = (60, 170)
TENSORS = {"activation": (128, 64, 768), "gradient": (768, 3072)}
CODECS = ["none", "fp16", "bf16", "int8", "int8(scale=bf16)", "int8(block=32, scale=bf16)", "int4",
          "svd(0.9)", "svd(0.6)", "svd(0.2)", "fp16(svd(0.9))", "fp16(svd(0.6))", "fp16(svd(0.2))",
          "lowrank(0.2)", "lowrank(0.2, iters=2)", "fp16(lowrank(0.2))", "int8(lowrank(0.2))", "int4(lowrank(0.4))",
          "topk(0.01)", "fp16(topk(0.01))"]
QUICK_CODECS = ["none", "fp16", "int8", "svd(0.2)", "fp16(svd(0.6))", "lowrank(0.2)", "int8(lowrank(0.2))",
                "topk(0.01)"]
SLOW_BUDGET_S = 3.0  # stop repeating a slow codec once it has used this long (and has 3 samples)
# Every row travels in the envelope of a real forward message (a job name and addresses as long as the shipped
# two-site jobs'; seq, base, step, micro-batch, generation and the channel's microsecond epoch at sizes a long
# run reaches), so `env B` is what such a message carries. docs/protocol.md's envelope sizes are computed
# from this message.
REFERENCE_MESSAGE = {"job": "example-job", "src": "a/stage-1/0", "dst": "b/stage-2/0", "topic": "fwd",
                     "seq": 10 ** 6, "base": 10 ** 6, "step": 10 ** 5, "micro_batch": 15, "generation": 100,
                     "epoch": 1 << 53}


def register(sub) -> None:
    parser = sub.add_parser("codecs", help="compression ratio, error and speed of every codec")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per (tensor, codec)")
    parser.add_argument("--repeat", type=int, default=7, help="timed repeats per codec (median; default 7)")
    parser.add_argument("--quick", action="store_true", help="activation tensor and a few codecs only")
    parser.add_argument("--codec", action="append", help="benchmark only this spec (repeatable)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # why here: torch, protobuf, kept off `nebula --help`
    import torch

    from nebula.codecs import parse

    torch.manual_seed(0)
    specs = args.codec or (QUICK_CODECS if args.quick else CODECS)
    codecs = [parse(spec) for spec in specs]  # bad specs fail before anything runs
    tensors = {"activation": TENSORS["activation"]} if args.quick else TENSORS
    rows = []
    if not args.json:
        print(header(), flush=True)
    for tensor, shape in tensors.items():
        for data in ("lowrank", "random"):
            x = make_tensor(shape, data)
            for codec in codecs:
                rows.append(measure(tensor, data, x, codec, max(1, args.repeat)))
                if not args.json:
                    print(format_row(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def make_tensor(shape: tuple[int, ...], data: str):
    """`lowrank`: rank-32 signal + 10% Gaussian noise (by norm) over the last dim; `random`: Gaussian."""
    # why here: torch, kept off `nebula --help`
    import torch

    if data == "random":
        return torch.randn(shape)
    m, n = shape[0] if len(shape) == 2 else shape[0] * shape[1], shape[-1]
    signal = torch.randn(m, 32) @ torch.randn(32, n)
    noise = torch.randn(m, n)
    return (signal + 0.1 * noise * signal.norm() / noise.norm()).view(shape)


def wire_message(payload):
    """The message a row's tensor is measured through (REFERENCE_MESSAGE)."""
    # why here: protobuf, kept off `nebula --help`
    from nebula.wire import Kind, Message

    return Message(Kind.TENSORS, tensors=[payload], **REFERENCE_MESSAGE)


def measure(tensor: str, data: str, x, codec, repeat: int) -> dict[str, Any]:
    # why here: protobuf, kept off `nebula --help`
    from nebula.codecs import CodecState, pack, unpack
    from nebula.wire import decode_message, encode_message

    state, encode_s, decode_s, spent = CodecState(), [], [], 0.0
    for _ in range(repeat):
        slot = state.slot("bench", tensor)  # stateful codecs (ef) keep state across repeats
        t0 = time.perf_counter()
        payload = pack(tensor, "activation", x, codec, state=slot)
        t1 = time.perf_counter()
        frames = encode_message(wire_message(payload))
        received = decode_message(frames).tensors[0]  # zero-copy, checksummed: what a receiver gets
        t2 = time.perf_counter()
        y = unpack(received)
        t3 = time.perf_counter()
        encode_s.append(t1 - t0)
        decode_s.append(t3 - t2)
        spent += t3 - t0
        if spent > SLOW_BUDGET_S and len(encode_s) >= 3:
            break
    raw_bytes = x.numel() * 4
    row = {"tensor": tensor, "data": data, "codec": codec.spec, "shape": list(x.shape),
           "ratio": payload.wire_bytes / raw_bytes, "rel_error": float((y - x).norm() / x.norm()),
           "encode_ms": 1e3 * statistics.median(encode_s), "decode_ms": 1e3 * statistics.median(decode_s),
           "repeats": len(encode_s), "wire_bytes": payload.wire_bytes, "raw_bytes": raw_bytes,
           "header_bytes": len(frames[0]), "meta_bytes": len(payload.meta)}
    for rate in RATES_MBIT:
        wire_ms = payload.wire_bytes * 8 / (rate * 1e6) * 1e3
        raw_ms = raw_bytes * 8 / (rate * 1e6) * 1e3
        row[f"total_ms_{rate}"] = row["encode_ms"] + wire_ms + row["decode_ms"]
        row[f"speedup_{rate}"] = raw_ms / row[f"total_ms_{rate}"]
    return row


def header() -> str:
    return (f"{'tensor':10} {'data':7} {'codec':22} {'ratio':>7} {'rel_err':>8} {'enc ms':>8} {'dec ms':>7} "
            + " ".join(f"{f'@{r} ms':>9} {'x raw':>6}" for r in RATES_MBIT))


def format_row(row: dict[str, Any]) -> str:
    return (f"{row['tensor']:10} {row['data']:7} {row['codec']:22} {row['ratio']:7.4f} {row['rel_error']:8.5f} "
            f"{row['encode_ms']:8.2f} {row['decode_ms']:7.2f} {row['header_bytes']:5d} "
            + " ".join(f"{row[f'total_ms_{r}']:9.0f} {row[f'speedup_{r}']:6.2f}" for r in RATES_MBIT))
