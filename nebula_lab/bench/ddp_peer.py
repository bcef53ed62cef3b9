"""The peer a user would run instead of replicas: PyTorch DDP, every step's gradients all-reduced by gloo in
float32, no compression (`nebula bench wan --scenario replicas --peer ddp`; nebula_lab.bench.replicas runs it).

One process per replica's site: rank k builds the model exactly as replica k's stage does
(nebula.runtime.service.build_stage on the replica's view of the job: the same module, initialisation,
AdamW, LR schedule), wraps the scenario's `peer_module` of it in DistributedDataParallel and trains on
replica k's shard (nebula.runtime.order: the same examples in the same micro-batches, the first m - 1
under no_sync, so one all-reduce per step). Its gradient is then the mean over the ranks', the global
batch's: R ranks x batch_size windows, as the R replicas take per step together. Rank 0 scores the
validation loss every --eval-every steps (the scenario's `peer_eval`, the windows the runtime scores).

On the emulated WAN each rank runs in its site's namespace and gloo connects every pair over their own
link (WanLink.route_homes); without one, on loopback. Per step each rank records step_s, the loss and
compute_s, wall time as Nebula's stages count it: the optimiser step and m times the mean of the first m - 1
micro-batches (their forward and backward under no_sync: no communication), since the last one's backward
also waits for the all-reduce, which DDP overlaps with it.

    python -m nebula_lab.bench.ddp_peer --job JOB --scenario gpt --rank K --master ADDR:PORT --steps N \\
        --out DIR [--eval-every E]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from nebula_lab.bench.torch_peer import free_port, supervise


def run_ranks(run: Path, job_file: Path, scenario: str, count: int, steps: int, eval_every: int,
              link=None, timeout_s: float = 3600.0) -> None:
    """Every rank (in its site's namespace with `link`); waits for all, raises with a log tail if one fails."""
    run.mkdir(parents=True, exist_ok=True)
    if link is not None:
        link.route_homes()
    host = link.home(link.sites[0])[0] if link is not None else "127.0.0.1"
    master = f"{host}:{20000 + free_port() % 20000}"
    procs = []
    for rank in range(count):
        device = link.home(link.sites[rank])[1] if link is not None else "lo"
        prefix = link.exec_prefix(link.sites[rank]) if link is not None else []
        argv = [*prefix, sys.executable, "-m", "nebula_lab.bench.ddp_peer", "--job", str(job_file), "--rank",
                str(rank), "--master", master, "--steps", str(steps), "--eval-every", str(eval_every),
                "--out", str(run), "--scenario", scenario]
        log = open(run / f"rank{rank}.log", "w")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": device}
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    supervise(procs, run, timeout_s, "DDP peer")


# --- in a rank's process -------------------------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nebula.runtime.job import load_job
    from nebula.runtime.order import ExampleOrder
    from nebula.runtime.service import build_stage
    from nebula_lab.bench.scenarios import load_scenario

    scenario, job = load_scenario(args.scenario), load_job(args.job)
    assert job.replicas is not None and len(job.stages) == 1  # the bench replicates one whole-model stage
    count, view = job.replicas.count, job.replica_view(args.rank)
    name, train = next(iter(view.stages)), view.train
    stage = build_stage(view, name, args.out / f"rank{args.rank}", quiet=True)
    dist.init_process_group("gloo", rank=args.rank, world_size=count, init_method=f"tcp://{args.master}")
    module = scenario.peer_module(stage, True, True, torch.float32)  # the stage's own module, tokens in, logits out
    model = DistributedDataParallel(module)
    order = ExampleOrder(len(stage.examples("train")), train.batch_size, train.seed, (args.rank, count))
    m, records, curve = train.micro_batches, [], []
    before = time.perf_counter()
    for t in range(1, args.steps + 1):
        cpu, indices, losses, walls = time.thread_time(), order.indices(t), [], []
        for k in range(m):  # Nebula's micro-batch k: every m-th example of the step, from the k-th
            started = time.perf_counter()
            inputs, targets = scenario.peer_batch(stage, indices[k::m])
            with model.no_sync() if k < m - 1 else contextlib.nullcontext():
                loss = scenario.peer_loss(model(inputs), targets) / m
                loss.backward()
            losses.append(float(loss.detach()) * m)
            walls.append(time.perf_counter() - started)
        started = time.perf_counter()
        stage.optimizer.step()
        stage.scheduler.step()
        stage.optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        compute = m * sum(walls[:-1]) / (m - 1) if m > 1 else time.thread_time() - cpu
        records.append({"step": t, "t": time.time(), "step_s": now - before, "compute_s": compute + now - started,
                        "loss": sum(losses) / m})
        if args.rank == 0 and args.eval_every and t % args.eval_every == 0:
            curve.append({"step": t, "loss": scenario.peer_eval(stage, module)})
            print(f"step {t}/{args.steps}: validation loss {curve[-1]['loss']:.4f}", flush=True)  # progress
        before = time.perf_counter()
    out = args.out / f"rank{args.rank}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if args.rank == 0:  # and its final weights, which every rank holds alike
        (out / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
        torch.save({n: p.detach().clone() for n, p in stage.trainable().items()}, out / "weights.pt")
    # DDP's reducer holds the process group: were it the last holder, gloo's threads would be joined with the
    # GIL held while one of them waits for the GIL, a deadlock about 1 run in 7 here (pytorch/pytorch#56297)
    del model
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True, help="the replicated job (its [replicas]: R, shards)")
    parser.add_argument("--scenario", required=True, help="the workload's scenario (its peer_* hooks)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    rank_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
