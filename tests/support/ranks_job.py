"""One rank of a two-stage job whose sink has 2 ranks (gloo on loopback); the source and the sink's rank 0
run in the rank-0 process over an in-process hub. `python -m tests.support.ranks_job SINK_IMPL ROOT`
with RANK, WORLD_SIZE=2, MASTER_ADDR and MASTER_PORT set; rank 0 prints one JSON line: each stage's
error, or null."""
import json
import os
import sys
import threading
from pathlib import Path

from nebula.runtime.ranks import RankGroup
from nebula.runtime.service import build_stage, make_runner
from nebula.transport.inproc import InProcHub
from tests.support.runtime import example_job


def main(impl: str, root: Path) -> None:
    job = example_job(stages=2, sink_impl=impl, sink_ranks=2, steps=6, checkpoint_every=3)
    rank = int(os.environ["RANK"])
    sink = build_stage(job, "sink", root / "sink", quiet=True, rank=rank, world=2, local_rank=rank)
    group = RankGroup.join(job, "sink", sink, rank, 2, timeout=60)
    if rank:
        return group.serve()
    hub = InProcHub()
    channels = {n: hub.channel(job.stage(n).address) for n in job.stages}
    runners = {"src": make_runner(job, "src", build_stage(job, "src", root / "src", quiet=True), channels["src"],
                                  timeout=20.0),
               "sink": make_runner(job, "sink", sink, channels["sink"], ranks=group, timeout=20.0)}
    errors = {}

    def run(name):
        try:
            runners[name].run()
            errors[name] = None
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[name] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    print(json.dumps(errors), flush=True)
    os._exit(0)  # the group's threads may still wait on a rank that is gone


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
