"""Data parallelism inside a stage, on torch.distributed: rank 0 owns the links, the others work for it.

A stage with `ranks = N` is N processes in one process group (torchrun's variables; gloo on CPU,
NCCL where each rank has a GPU of its own, gloo again where ranks share one: see group_backend).
Rank 0 runs the StageRunner: it receives every message, and hands micro-batch k of a step to rank
(k + 1) mod N ("scatter"; rank 0's share last, see owner); what a rank produces for a link (activations forward,
gradients of its inputs back) goes to rank 0, which sends it ("gather"). At a step's end every
rank applies the step together: gradients are summed with `all_reduce` (each micro-batch's loss is
already divided by the micro-batches of the whole step, so the sum equals one rank's gradient over
the same global batch), then each rank takes the same optimiser step. Rank 0 writes the
checkpoints; on a resume it sends the checkpoint to the others.

Work items and what ranks send back are Nebula wire messages (nebula.wire, uncompressed), carried
as one uint8 tensor each (after its size) over two gloo groups of their own: one from rank 0
(scatter, posted without waiting for each rank to take it), one to it (gather, read by a relay
thread, so a rank never waits on rank 0's compute). A rank reads its work in order, so rank 0 hands
out the next step's micro-batches of the other ranks while the step is applied (before the
all-reduce, not after it): every rank starts the next step as soon as the all-reduce ends (handed out
one by one after the apply, the n - 1 ranks started their micro-batches ~55 ms apart in all at n = 8 on
one core, Table 4, and the step waited for the last). RankGroup is the stage's compute
(nebula.runtime.compute) at rank 0: a micro-batch of another rank is a message to it, rank 0's own
share runs in its executor. At a stage no gradient comes back to, a rank runs a micro-batch's forward and
backward as one work item (its input gradient is sent before its weight gradient is computed).
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from nebula.codecs import pack, unpack
from nebula.errors import ConfigError, StageError, TransportError
from nebula.runtime import checkpoint
from nebula.runtime.compute import Compute, Part, Tally
from nebula.runtime.executor import Executor
from nebula.runtime.graph import Item
from nebula.runtime.stage import Batch, Output, Stage
from nebula.wire import Kind, Message, decode_message, encode_message

log = logging.getLogger(__name__)

COUNT, BODY = 1, 2  # p2p tags: a message's frame count and size (any source), then its lengths and frames
RELAY_GRACE_S = 2.0  # how long a failed collective waits for a failed rank's ERROR (see _lost)


def pack_message(msg: Message) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, body): the frame count and body size, then the frames' lengths and the frames. Two sends
    whatever the frames: each gloo send is a rendezvous with the receiving process, and with n ranks
    sharing a core (Table 4's emulated device) one send per frame made rank 0's scatter of a step's
    micro-batches take ~90 ms at n = 8. The frames (ids, activations) are copied once."""
    frames = [memoryview(f).cast("B") for f in encode_message(msg)]
    blob = bytearray(struct.pack(f"<{len(frames)}q", *(len(f) for f in frames)))
    for frame in frames:
        blob += frame
    return torch.tensor([len(frames), len(blob)]), torch.frombuffer(blob, dtype=torch.uint8)


def send_message(msg: Message, dst: int, group: Any) -> None:
    head, body = pack_message(msg)
    dist.send(head, dst, group=group, tag=COUNT)
    dist.send(body, dst, group=group, tag=BODY)


def recv_message(src: int | None, group: Any) -> tuple[int, Message]:
    head = torch.zeros(2, dtype=torch.int64)
    sender = dist.recv(head, src, group=group, tag=COUNT)
    count, size = head.tolist()
    body = torch.empty(size, dtype=torch.uint8)
    dist.recv(body, sender, group=group, tag=BODY)
    blob = body.numpy().data  # a memoryview: the frames are views of it (decode_message takes buffers)
    frames, offset = [], 8 * count
    for n in struct.unpack_from(f"<{count}q", blob):
        frames.append(blob[offset:offset + n])
        offset += n
    return sender, decode_message(frames)


def group_backend(spec: str, device_type: str, local_world: int, gpus: int) -> str:
    """The process group's backend: NCCL where every rank on this host has a GPU of its own, else gloo.
    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), which is what `auto` or `cuda` gives
    with more ranks than GPUs (rank r on cuda:r mod GPUs) and `cuda:N` with more than one rank; gloo
    reduces CUDA tensors through host memory, so such a stage still trains, only slower."""
    if device_type != "cuda":
        return "gloo"
    own_gpu = local_world == 1 or (spec in ("auto", "cuda") and local_world <= gpus)
    return "nccl" if own_gpu else "gloo"


class RankGroup(Compute):
    def __init__(self, job: Any, name: str, stage: Stage, rank: int, world: int, scatter: Any, gather: Any):
        self.job, self.name, self.stage, self.rank, self.world = job, name, stage, rank, world
        self.scatter, self.gather = scatter, gather
        self.items = job.graph.items(name)
        # a stage no gradient comes back to: a rank runs a micro-batch's backward with its forward
        self.fused = not job.graph.waits_for_gradients(name)
        self.error: str | None = None
        self.gone = False  # the error is a rank that went away (killed, its host lost), not one that failed itself
        self.generation = 0  # ranks > 0: of the work item in progress, stamped on what it sends
        self.emit: Callable[..., None] | None = None  # rank 0: the outbox's emit
        self.current: Callable[[], int] = lambda: 0  # rank 0: the generation work is handed out in
        self.executor = Executor.for_job(job, name, stage, self._emit, reduce=self.reduce)
        self._relay: threading.Thread | None = None
        self._posted: list[tuple[list[Any], tuple[torch.Tensor, ...]]] = []  # rank 0: sends in flight, buffers

    @classmethod
    def join(cls, job: Any, name: str, stage: Stage, rank: int, world: int, timeout: float = 600.0) -> RankGroup:
        """This process's place in the stage's group (MASTER_ADDR and MASTER_PORT say where to meet)."""
        try:  # torchrun and the supervisor set it; without it, assume every rank is on this host
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        except ValueError as exc:
            raise ConfigError(f"LOCAL_WORLD_SIZE must be an integer: {exc}") from None
        gpus = torch.cuda.device_count() if stage.device.type == "cuda" else 0
        backend = group_backend(job.stage(name).device, stage.device.type, local, gpus)
        if backend == "gloo" and stage.device.type == "cuda" and rank == 0:
            log.warning("stage %s: its %d ranks on this host share %d GPU(s), and NCCL needs a GPU per rank: "
                        "the ranks sum gradients with gloo through host memory (slower); give each rank a GPU "
                        "for NCCL", name, local, gpus)
        try:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError) as exc:
            raise StageError(f"stage {name} rank {rank}/{world}: cannot join its process group ({exc}); "
                             "are MASTER_ADDR and MASTER_PORT the same for every rank?") from exc
        scatter, gather = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        return cls(job, name, stage, rank, world, scatter, gather)

    # -- rank 0 --------------------------------------------------------------------------------------
    def attach(self, emit: Callable[..., None], generation: Callable[[], int]) -> None:
        """Rank 0: `emit(direction, link, step, micro_batch, tensors, ids, generation=)` sends on a link;
        `generation()` is the one work is handed out in (what a rank sends back carries it)."""
        self.emit, self.current = emit, generation
        self.executor.emit = emit
        self._relay = threading.Thread(target=self._relay_loop, name=f"nebula-ranks-{self.name}", daemon=True)
        self._relay.start()

    def owner(self, index: int) -> int:
        """Rank 0 computes on the runner's thread, which hands out the step's micro-batches in order:
        its share comes last of every N, so the others' are already out (with k mod N, a sink's
        rank 0 held micro-batches 1..N-1 back for its whole forward and backward of micro-batch 0)."""
        return (index + 1) % self.world

    def ready_for(self, step: int) -> bool:
        return self.executor.ready_for(step)

    def elsewhere(self, index: int) -> bool:
        return self.owner(index) != 0

    def forward(self, batch: Batch, inputs: dict, item: Item) -> None:
        if self.owner(item.index) == 0:
            return self.executor.forward(batch, inputs, item)
        body = {"index": item.index, "split": batch.split, "training": batch.training, "indices": batch.indices,
                "generation": self.current()}
        tensors = [pack(n, "input", t.detach().cpu(), "none") for n, t in inputs.items()]
        tensors.append(pack("example_ids", "ids", batch.ids, "none"))
        self._send("forward", self.owner(item.index), batch.step, body, tensors, wait=False)

    def backward(self, step: int, index: int, grads: dict[str, dict], part: Part) -> None:
        if self.owner(index) == 0:
            return self.executor.backward(step, index, grads, part)
        if self.fused:
            return  # that rank ran it with the forward
        names = [[link, name] for link, tensors in grads.items() for name in tensors]
        tensors = [pack(name, "gradient", grads[link][name].detach().cpu(), "none") for link, name in names]
        body = {"index": index, "names": names, "part": part, "generation": self.current()}
        self._send("backward", self.owner(index), step, body, tensors, wait=False)

    def reset(self, step: int) -> None:
        self.executor.reset(step)

    def infer_forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        return self.executor.infer_forward(batch, inputs)

    def apply(self, step: int, ahead: Callable[[], None] | None = None) -> Tally:
        """Every rank applies `step`; `ahead` may hand out the next step's micro-batches of the other ranks
        first (they read them after this apply), so that the scatter overlaps the all-reduce."""
        for rank in range(1, self.world):
            self._send("apply", rank, step, {}, wait=False)
        self.drain()  # not what `ahead` posts: a rank takes it only after the all-reduce below
        if ahead is not None:
            ahead()
        return self._apply(step)

    def skip(self, step: int) -> None:
        """Every rank moves past `step` without an update."""
        for rank in range(1, self.world):
            self._send("skip", rank, step, {}, wait=False)
        self.executor.skip(step)

    def restore(self, checkpoint: Path) -> None:
        data = torch.frombuffer(bytearray(Path(checkpoint).read_bytes()), dtype=torch.uint8)
        for rank in range(1, self.world):
            self._send("restore", rank, 0, {}, [pack("checkpoint", "state", data, "none")])

    def broadcast_weights(self) -> None:
        """Rank 0's trainable weights to every other rank (an outer round wrote them: nebula.runtime.replicas)."""
        weights = [pack(n, "weight", p.detach().cpu(), "none") for n, p in self.stage.trainable().items()]
        for start in range(0, len(weights), 200):  # a message carries at most 256 tensors (nebula.wire)
            for rank in range(1, self.world):
                self._send("weights", rank, 0, {}, weights[start:start + 200])

    def check(self) -> None:
        if self.error is not None and self.gone:  # restarted with the others, as a killed stage is: nobody to blame
            raise TransportError(self.error)
        if self.error is not None:
            raise StageError(f"stage {self.name}: {self.error}")

    def _lost(self, exc: RuntimeError) -> StageError | TransportError:
        """A send or all_reduce of the group failed. A rank that failed by itself (bad data, a bug) said why
        on the gather group before it left, so the relay gets RELAY_GRACE_S to hear it: that is the stage's
        own failure, told to its peers. Otherwise another rank is gone (killed, its host lost), and the
        launcher restarts them together."""
        if self._relay is not None and self._relay is not threading.current_thread():
            self._relay.join(RELAY_GRACE_S)
        if self.error is not None and not self.gone:
            return StageError(f"stage {self.name}: {self.error}")
        return TransportError(f"stage {self.name} rank {self.rank}/{self.world}: another rank of the stage is gone "
                              f"({type(exc).__name__}: {str(exc)[:300]})")

    def close(self) -> None:
        """Rank 0: stop the other ranks (each says bye, which ends the relay), leave the group."""
        if self.rank == 0 and dist.is_initialized() and self.error is None:
            try:
                for rank in range(1, self.world):
                    self._send("stop", rank, 0, {})
                if self._relay is not None:
                    self._relay.join(30)
            except TransportError:
                pass  # a rank is gone already: the group goes anyway
        if dist.is_initialized():
            dist.destroy_process_group()

    def _send(self, what: str, rank: int, step: int, body: dict, tensors: list | None = None,
              wait: bool = True) -> None:
        """wait=False: posted (gloo isend), so that a step's scatter does not wait on each rank in turn to
        take its micro-batch; drain() before the step's collectives (a rank reads its messages in order)."""
        msg = Message(kind=Kind.TENSORS, topic=what, step=step, body=json.dumps(body).encode(), tensors=tensors or [])
        head, blob = pack_message(msg)
        try:
            works = [dist.isend(head, rank, group=self.scatter, tag=COUNT),
                     dist.isend(blob, rank, group=self.scatter, tag=BODY)]
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        self._posted.append((works, (head, blob)))
        if wait or len(self._posted) > 8 * self.world:  # steps without an apply (evaluation) bound it too
            self.drain()

    def drain(self) -> None:
        """Rank 0: wait for every posted send (their buffers live until then)."""
        try:
            for works, _ in self._posted:
                for work in works:
                    work.wait()
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        finally:
            self._posted.clear()

    def _relay_loop(self) -> None:
        """Rank 0: what the other ranks send on links goes out through the runner's sender."""
        byes: set[int] = set()
        emit = self.emit
        assert emit is not None  # attach() set it before starting this thread
        try:
            while len(byes) < self.world - 1:
                try:
                    rank, msg = recv_message(None, self.gather)
                except RuntimeError as exc:  # a rank that fails itself sends an ERROR (below) instead
                    if dist.is_initialized() and self.error is None:
                        self.gone = True
                        self.error = str(self._lost(exc))
                    return
                if msg.kind == Kind.ERROR:
                    self.error = f"rank {rank} failed: {msg.error_message}"
                    return
                if msg.kind == Kind.CONTROL:  # "bye": that rank has stopped
                    byes.add(rank)
                    continue
                body = json.loads(msg.body)
                tensors = {t.name: unpack(t) for t in msg.tensors}
                ids = tensors.pop("example_ids", None)
                link = self.job.graph.link(body["link"])
                emit(msg.topic, link, msg.step, msg.micro_batch, tensors, ids, generation=body["generation"])
        except Exception as exc:  # noqa: BLE001 - kept and raised on the stage's thread
            if dist.is_initialized() and self.error is None:
                self.error = f"the relay from the other ranks failed: {type(exc).__name__}: {exc}"

    # -- every rank ----------------------------------------------------------------------------------------
    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of every rank (one flat all_reduce)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        try:
            dist.all_reduce(flat)
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        offset = 0
        for param, grad in zip(params, grads):
            param.grad = flat[offset:offset + grad.numel()].view_as(param)
            offset += grad.numel()

    def _apply(self, step: int) -> Tally:
        tally = self.executor.apply(step)
        keys = type(self.stage).stats  # declared by the class: every rank sums the same list
        stats = torch.tensor([sum(tally.losses), len(tally.losses), *(tally.stats.get(k, 0.0) for k in keys)],
                             dtype=torch.float64)
        compute = torch.tensor([tally.compute_s], dtype=torch.float64)
        if dist.get_backend() == "nccl":  # NCCL reduces only device tensors; gloo takes either
            stats, compute = stats.to(self.stage.device), compute.to(self.stage.device)
        try:
            dist.all_reduce(stats)
            dist.all_reduce(compute, op=dist.ReduceOp.MAX)
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        total, n, *sums = stats.tolist()
        return Tally(losses=[total / n] if n else [], compute_s=float(compute), stats=dict(zip(keys, sums)))

    # -- ranks > 0 ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Work for rank 0 until it says stop (or fails: then rank 0 hears why)."""
        try:
            while self._serve_one():
                pass
            send_message(Message(kind=Kind.CONTROL, topic="bye"), 0, self.gather)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"[:4000]
            try:
                send_message(Message(kind=Kind.ERROR, error_code="stage", error_message=text), 0, self.gather)
            except RuntimeError:
                pass  # rank 0 is gone: nothing to tell
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def _serve_one(self) -> bool:
        _, msg = recv_message(0, self.scatter)
        body = json.loads(msg.body)
        tensors = {t.name: unpack(t) for t in msg.tensors}
        self.generation = body.get("generation", 0)
        if msg.topic == "forward":
            ids = tensors.pop("example_ids")
            item = self.items[body["index"]]
            batch = Batch(body["split"], msg.step, item.index, ids=ids, training=body["training"],
                          indices=body["indices"], link=item.link.name if item.link else None)
            self.executor.forward(batch, {n: t.to(self.stage.device) for n, t in tensors.items()}, item)
            if self.fused:  # its input gradient goes back before its weight gradient is computed
                self.executor.backward(msg.step, item.index, {}, "input")
                self.executor.backward(msg.step, item.index, {}, "weight")
        elif msg.topic == "backward":
            grads: dict[str, dict] = {}
            for (link, name), tensor in zip(body["names"], tensors.values()):
                grads.setdefault(link, {})[name] = tensor.to(self.stage.device)
            self.executor.backward(msg.step, body["index"], grads, body["part"])
        elif msg.topic == "apply":
            self._apply(msg.step)
        elif msg.topic == "skip":
            self.executor.skip(msg.step)
        elif msg.topic == "restore":
            state = checkpoint.read(tensors["checkpoint"].numpy().tobytes())
            self.stage.load_state_dict(state["stage"])
            checkpoint.set_rng_state(state, self.stage.device)
            self.executor.reset(int(state["step"]))
        elif msg.topic == "weights":
            with torch.no_grad():
                params = self.stage.trainable()
                for name, tensor in tensors.items():
                    params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        elif msg.topic == "stop":
            return False
        else:
            raise StageError(f"rank {self.rank} of stage {self.name}: unknown work item {msg.topic!r}")
        return True

    def _emit(self, direction: str, link: Any, step: int, micro_batch: int, tensors: dict, ids: Any) -> None:
        """Ranks > 0: what the executor sends on a link goes to rank 0 first."""
        payloads = [pack(n, direction, t.detach().cpu(), "none") for n, t in tensors.items()]
        if ids is not None:
            payloads.append(pack("example_ids", "ids", ids, "none"))
        body = {"link": link.name, "generation": self.generation}
        send_message(Message(kind=Kind.TENSORS, topic=direction, step=step, micro_batch=micro_batch,
                             body=json.dumps(body).encode(), tensors=payloads), 0, self.gather)
