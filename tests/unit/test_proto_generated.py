"""The committed generated protobuf code and its type stubs must match what scripts/gen_proto produces now."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    *map(str, (ROOT / "proto").glob("*.proto"))], check=True)
    generated_files = sorted(tmp_path.glob("*_pb2.py*"))
    assert generated_files, "protoc generated nothing"
    for generated in generated_files:
        committed = ROOT / "nebula" / "_proto" / generated.name
        assert committed.read_text() == generated.read_text(), \
            f"{committed.name} is stale: run scripts/gen_proto and commit the result"
