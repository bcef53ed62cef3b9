"""The peer a user would run instead: a job's stage chain under torch.distributed.pipelining, over the
same emulated WAN (`nebula bench wan --scenario gpt --peer torch`; nebula_lab.bench.pipeline runs it).

One process per site, each in its site's namespace (nebula_lab.wanem), one gloo process group over the
sites' links; each rank builds its stage exactly as Nebula does (nebula.runtime.service.build_stage:
the same module, initialisation, optimiser, LR schedule and data), wraps the module in a `PipelineStage`
(the scenario's `peer_module`: how torch's pipeline calls it) and trains with `ScheduleGPipe` or
`Schedule1F1B` (gloo P2P, no encryption, no gateway). The batch of
each step is the job's (nebula.runtime.order), its micro-batches the ones Nebula's stages take (every
m-th example), so both systems train on the same data in the same micro-batches. `--boundary bf16`
sends activations and their gradients in bfloat16, as Nebula's `bf16` codec does on both directions.

Routing: gloo gives each rank one address, and every pair of ranks connects. In the emulated mesh every
two sites have their own link (a /30 each), so each site's "home" is its address on its first link,
and every other site gets a /32 route to it over their direct link (through the delay line where the
mesh has one): each pair's traffic stays on its own shaped link, as Nebula's gateway-to-gateway
traffic does.

    python -m nebula_lab.bench.torch_peer --job JOB --rank R --master ADDR:PORT --schedule 1f1b \\
        --steps N --out DIR [--boundary bf16]          # one rank, inside its site's namespace
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


# --- in the bench's process (root): routes, ranks --------------------------------------------------------
def home(link, site: str) -> tuple[str, str]:
    """(the site's address gloo uses, the device it is on): its end of its link to the first other site."""
    peer = link.peers(site)[0]
    return link.address(site, peer), link.device(site, peer)


def add_routes(link) -> None:
    """Every site reaches every other's home over their direct link (see the module docstring)."""
    from nebula_lab.wanem import DELAY_PREFIX, _ip
    for site in link.sites:
        for other in link.peers(site):
            far, _ = home(link, other)
            if far == link.address(other, site):
                continue  # on-link already: their link's /30
            ns = link.namespace(site)
            if link.rtt_ms:
                _ip("-n", ns, "route", "add", f"{far}/32", "dev", DELAY_PREFIX + other, "src",
                    link.address(site, other))
            else:
                _ip("-n", ns, "route", "add", f"{far}/32", "dev", link.device(site, other), "src",
                    link.address(site, other))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(run: Path, job_file: Path, scenario: str, link, schedule: str, steps: int, boundary: str,
              timeout_s: float) -> None:
    """Every rank in its site's namespace; waits for all, raises with a log tail if one fails."""
    run.mkdir(parents=True, exist_ok=True)
    master = f"{home(link, link.sites[0])[0]}:{20000 + free_port() % 20000}"
    procs = []
    for rank, site in enumerate(link.sites):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": home(link, site)[1]}
        argv = [*link.exec_prefix(site), sys.executable, "-m", "nebula_lab.bench.torch_peer", "--job", str(job_file),
                "--rank", str(rank), "--master", master, "--schedule", schedule, "--steps", str(steps),
                "--boundary", boundary, "--out", str(run), "--scenario", scenario]
        log = open(run / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    supervise(procs, run, timeout_s, f"torch.distributed.pipelining {schedule}")


def supervise(procs: list, run: Path, timeout_s: float, who: str) -> None:
    """Wait for every rank's (process, log); the first that fails, or the deadline, raises with a log tail
    (`run`/rank<i>.log); whatever still runs is killed. The DDP peer's ranks too (nebula_lab.bench.ddp_peer)."""
    from nebula.errors import StageError
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p, _ in procs):
            failed = [i for i, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                what = f"rank {failed[0]} failed" if failed else f"did not finish in {timeout_s:.0f} s"
                tail = (run / f"rank{failed[0] if failed else 0}.log").read_text()[-3000:]
                raise StageError(f"{who}: {what}; log tail:\n{tail}")
            time.sleep(0.5)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


# --- in a rank's process -------------------------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from nebula.runtime.job import load_job
    from nebula.runtime.order import ExampleOrder
    from nebula.runtime.service import build_stage
    from nebula_lab.bench.scenarios import load_scenario

    faulthandler.dump_traceback_later(600, repeat=True)  # a rank that hangs says where, in its log
    scenario, job = load_scenario(args.scenario), load_job(args.job)
    names, train = list(job.stages), job.train
    name, world = names[args.rank], len(names)
    stage = build_stage(job, name, args.out / name, quiet=True)
    first, last = args.rank == 0, args.rank == world - 1
    dist.init_process_group("gloo", rank=args.rank, world_size=world, init_method=f"tcp://{args.master}")
    dtype = torch.bfloat16 if args.boundary == "bf16" else torch.float32
    module = scenario.peer_module(stage, first, last, dtype)  # the stage's own module, called as torch calls it
    pipe = pipelining.PipelineStage(module, args.rank, world, torch.device("cpu"))
    # every rank gets the loss: torch's schedule runs no backward at a rank without one (only the last calls it)
    schedule = getattr(pipelining, SCHEDULES[args.schedule])(pipe, n_microbatches=train.micro_batches,
                                                             loss_fn=scenario.peer_loss)
    order = ExampleOrder(len(stage.examples("train")), train.batch_size, train.seed)
    m = train.micro_batches
    records, before, cpu = [], time.perf_counter(), _cpu()
    for t in range(1, args.steps + 1):
        idx = order.indices(t)
        idx = [i for k in range(m) for i in idx[k::m]]  # torch chunks contiguously: Nebula's micro-batch k first
        inputs, targets = scenario.peer_batch(stage, idx)
        losses: list = []
        if first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        stage.optimizer.step()
        stage.scheduler.step()
        stage.optimizer.zero_grad(set_to_none=True)
        now, used = time.perf_counter(), _cpu()
        record = {"step": t, "t": time.time(), "step_s": now - before, "cpu_s": used - cpu}
        if losses:
            record["loss"] = float(sum(float(x) for x in losses) / len(losses))
        records.append(record)
        before, cpu = now, used
    records[-1]["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dist.destroy_process_group()


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--scenario", required=True, help="the workload's scenario (its peer_* hooks)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--boundary", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", type=Path, required=True)
    rank_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
