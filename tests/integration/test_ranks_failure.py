"""A rank of a data-parallel stage that fails by itself (bad data) is reported as the stage's own
failure, with its cause, and the stage's peers are told: not as "another rank is gone", a transport
failure that the supervisor would restart and the peers would wait out."""
import json
import os
import subprocess
import sys

from nebula.site.ports import free_port


def test_bad_data_on_rank_1_fails_the_stage_naming_the_cause(tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [sys.executable, "-m", "tests.support.ranks_job", "tests.support.runtime:BadDataSink", str(tmp_path)]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    (_, rank1_err), (out, err) = (p.communicate(timeout=120) for p in ranks)
    errors = json.loads(out.strip().splitlines()[-1]) if out.strip() else err[-3000:]
    assert errors["sink"].startswith("StageError: stage sink: rank 1 failed: DataError: bad example on rank 1"), errors
    assert errors["src"].startswith("PeerFailed:") and "bad example on rank 1" in errors["src"], errors
    assert "DataError: bad example on rank 1 at step 3" in rank1_err
