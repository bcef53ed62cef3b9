"""ELECTRA-Cloud stage modules (paper §3.1, §3.3): generators teach one discriminator; only ids cross.

- `electra-generator` (a source, one per language group and site): masked LM on its own text (L_G,
  Eq. 6); samples a replacement at every masked position (Eq. 7) and sends the corrupted ids
  `tokens` (B, S), the masked positions `positions` (B, K) and the original ids there `originals`
  (B, K), all int32; a row with fewer than K masked positions is padded with position -1, and an
  original the generator sampled right is sent as 0 (<pad>, never masked): it is the token itself.
- `electra-discriminator` (the sink, `ranks = n`): rank 0 is the paper's root discriminator D_r, which
  receives every generator's micro-batches and scatters them to the n ranks (the sub-discriminators
  D_sub, rank 0 among them); the ranks all-reduce and step together, then the root sends each
  generator its pace (the runtime's forward-only schedule with a credit, Figure 6). Its loss is
  lambda * L_D (replaced-token detection, Eq. 8) + gamma * L_CLM (corrective LM, Eq. 10), Eq. 11.

The link from a generator to the discriminator is one-way: no gradient crosses the WAN.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from nebula.config import limits
from nebula.errors import ConfigError, DataError
from nebula.runtime.job import JobConfig
from nebula.runtime.stage import Batch, Output, Port, Stage
from services.electra import data
from services.electra.calibrate import measure
from services.electra.device import DeviceTime
from services.electra.losses import discriminator_loss, generator_loss
from services.electra.model import Discriminator, Generator, Size, e5_discriminator, load_trained
from services.models.plm import BertModel, pad_rows

NO_POSITION = -1  # pads a row of `positions` (and its `originals`) to K
# Index-only: varint-friendly small ints (positions < max_len fit one byte), which `deflate` packs tightly;
# sending the originals as a (B, S) tensor, zero where not masked, cost 0.45 bytes per token more.
TOKENS = (Port("tokens", "int32", rank=2, role="tokens"),  # corrupted ids x_corrupt (B, S), <pad>-padded
          Port("positions", "int32", rank=2, role="positions"),  # M, the masked positions (B, K), ascending
          Port("originals", "int32", rank=2, role="labels"))  # x_i at those positions (B, K); 0: = tokens there
SAME = 0  # an original equal to the sampled token (the id of <pad>, which is never masked)


@dataclass(frozen=True, kw_only=True)
class _Options:
    max_len: int = field(default=128, metadata=limits(at_least=8, at_most=512, hint="tokens per sequence"))
    vocab_corpora: tuple[str, ...] = ("es-en", "zh-en")  # the vocabulary: every stage must name the same
    vocab_file: str | None = None  # a shipped vocabulary (`VocabMap` JSON) instead of building it here
    lr: float = field(default=5e-4, metadata=limits(above=0, below=1))
    warmup_steps: int = field(default=20, metadata=limits(at_least=0))
    # pin the stage's process to these CPU cores (a benchmark's: G on a core of its own); () = any
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class GeneratorOptions(_Options):
    corpus: str = "es-en"  # its language group: the directory under [job].data
    tasks: tuple[Literal["mrtd", "trtd"], ...] = ("mrtd", "trtd")
    mask_prob: float = field(default=0.15, metadata=limits(above=0, below=1))
    temperature: float = field(default=1.0, metadata=limits(above=0))
    size: Size = Size(hidden=128, layers=2, heads=2, ffn=512)
    # "random", or a generator checkpoint (`.../generator/checkpoints/step-N.pt`, relative to the job file)
    # whose weights G starts from: the paper distils from an existing well-trained model (§3.1), here G
    # after a one-site MLM phase (deploy/jobs/electra-generator.toml); its optimiser starts afresh
    init: str = "random"
    # true: G does not train during distillation (ELECTRA's two-stage variant, §3.2 of its paper): it samples
    # from its `init` weights, L_G is still computed and logged, no backward, no optimiser. A G still
    # learning moves D's target every step: at 2,000 steps of the demo's D, alignment 0.51 with G at lr 5e-4,
    # 0.53 at 1e-4, 0.58 frozen (docs/electra.md, "A frozen teacher")
    frozen: bool = False
    max_train_examples: int | None = field(default=None, metadata=limits(at_least=1))


@dataclass(frozen=True, kw_only=True)
class DiscriminatorOptions(_Options):
    size: Size = Size()
    init: Literal["random", "e5-small"] = "random"  # e5-small: 12 x 384, size is then ignored
    rtd_weight: float = field(default=50.0, metadata=limits(at_least=0, hint="lambda of Eq. 11"))
    clm_weight: float = field(default=1.0, metadata=limits(at_least=0, hint="gamma of Eq. 11"))
    # a benchmark's emulated device (services/electra/device.py): each micro-batch of each rank takes this
    # many seconds of wall clock, the stand-in model's real compute included; 0: off. It measures the
    # runtime's coordination overhead (paper Table 4), not compute scaling
    device_time: float = field(default=0.0, metadata=limits(at_least=0, hint="seconds per micro-batch"))
    # a benchmark's too: this many more gradient values in each all-reduce of the ranks (zeros, never applied),
    # so that a stand-in for a larger D on an emulated device synchronises as much as that D would
    sync_numel: int = field(default=0, metadata=limits(at_least=0, hint="gradient values"))


def pin(cpus: tuple[int, ...], key: str) -> None:
    """This process (its calling thread, and the threads it starts later: torch's) on `cpus` only."""
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise ConfigError(f"{key} = {list(cpus)}: this process may run on cores {sorted(allowed)} only")
    os.sched_setaffinity(0, set(cpus))


def linear_warmup_decay(optimizer: torch.optim.Optimizer, warmup: int, total: int):
    """The paper's schedule (§4.1): linear warm-up, then linear decay to zero at the last step."""
    warm, total = max(1, warmup), max(total, warmup + 1)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))


class _Electra(Stage):
    def __init__(self, context, options: _Options):
        super().__init__(context, options)
        if options.cpus:
            pin(options.cpus, f"[stages.{context.name}] cpus")

    def _vocabulary(self) -> None:
        if self.context.data is None:
            raise DataError(f"stage {self.context.name}: the job names no [job].data directory with the corpora")
        self.tok = data.tokenizer()
        self.vmap = data.load_vocab(self.context.data, self.options.vocab_corpora, self.options.vocab_file, self.tok)
        self.specials = self.vmap.specials(data.specials_of(self.tok))

    def _optimise(self) -> None:
        self.module.to(self.device)
        if not self.trainable():  # a frozen stage: nothing to step
            return
        self.optimizer = torch.optim.Adam(self.trainable().values(), lr=self.options.lr, betas=(0.9, 0.999),
                                          eps=1e-6)
        self.scheduler = linear_warmup_decay(self.optimizer, self.options.warmup_steps, self.context.job.train.steps)


def sample(scores: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per row of softmax(scores), (M, V) -> (M,), by inverting each row's CDF with one uniform draw.
    torch.multinomial draws the same distribution, but on a CPU it took 66 ms for ~150 rows of this 28,902-id
    vocabulary, half of G's compute a micro-batch; this takes ~6 ms. A category of probability 0 (a special, at
    -inf) is never drawn: the search finds the first i with cdf[i] > u, and the CDF does not rise at such an i;
    u is kept below the total even where rounding would lift it to it (a clamp to the last id could pick a
    category of probability 0 there). float32 throughout (a float64 softmax cost 8x): the CDF's rounding moves
    ~1e-7 of mass between neighbours."""
    cdf = F.softmax(scores, -1).cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(len(scores), 1, generator=gen, device=scores.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


@dataclass(frozen=True)
class Corrupted:
    """What the generator makes of a batch (B, S) of ids, M masked positions (row-major)."""

    tokens: torch.Tensor  # x_corrupt (B, S): each masked token replaced by G's sample
    at: torch.Tensor  # (B, S) bool, the masked positions M
    originals: torch.Tensor  # (M,) the ids that were there
    logits: torch.Tensor  # (M, V) p_G's logits there, with their autograd graph (L_G)
    sampled: torch.Tensor  # (M,) the replacements; equal to the original where G sampled it


class ElectraGenerator(_Electra):
    Options = GeneratorOptions
    outputs = TOKENS
    stats = ("tokens", "masked", "sequences")

    def __init__(self, context, options: GeneratorOptions):
        super().__init__(context, options)
        self._vocabulary()
        self.corpus = data.GeneratorCorpus(context.data, options.corpus, options.tasks, options.max_len, self.vmap,
                                           self.tok, options.max_train_examples)
        self.module = Generator(options.size.bert(len(self.vmap), options.max_len))
        if options.init != "random":
            load_trained(self.module, options.init, context.job.source, f"[stages.{context.name}] init")
        elif options.frozen:
            raise ConfigError(f"[stages.{context.name}] frozen = true with init = \"random\": a frozen generator "
                              "needs trained weights to sample from (init = a generator checkpoint)")
        self.module.requires_grad_(not options.frozen)
        self._optimise()

    def examples(self, split: str) -> list[str]:
        return self.corpus.splits[split].ids

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        ids = self.corpus.splits[batch.split].batch(batch.indices, self.specials.pad).to(self.device)
        masked = self.corrupt(ids, self._seed(batch))
        loss = generator_loss(masked.logits, masked.originals)  # L_G, Eq. 6
        positions, labels = ragged(masked.at, masked.originals.masked_fill(masked.sampled == masked.originals, SAME))
        stats = {"tokens": float((ids != self.specials.pad).sum()), "masked": float(masked.at.sum()),
                 "sequences": float(len(ids))}
        return Output(tensors={"tokens": masked.tokens.int(), "positions": positions.int(), "originals": labels.int()},
                      loss=loss, stats=stats)

    def corrupt(self, ids: torch.Tensor, seed: int) -> Corrupted:
        """Mask (B, S) ids and replace each masked token by a sample of p_G (Eqs. 6 and 7): masks and samples
        drawn from `seed` alone, so a step (or an evaluation's fixed corruption) is the same on every run."""
        at = self._choose_masked(ids, seed)
        logits = self.module(ids.masked_fill(at, self.specials.mask), ids != self.specials.pad, at)  # (M, V)
        with torch.no_grad():  # Eq. 7: sample x_i ~ p_G(x_i | x_mask) at each masked position
            gen = torch.Generator(device=self.device).manual_seed(seed + (1 << 62))  # not the mask's seed
            scores = logits.detach().float() / self.options.temperature
            # never a special (the first ids): no original is one, and a sampled <pad> would read as padding
            scores[:, :max(self.specials.as_list()) + 1] = float("-inf")
            sampled = sample(scores, gen)
        return Corrupted(ids.masked_scatter(at, sampled), at, ids[at], logits, sampled)

    def _seed(self, batch: Batch) -> int:
        """The same masks and samples for the same step after a resume, whatever ran before."""
        return (self.context.job.train.seed * 1_000_003 + batch.step * 4099 + batch.micro_batch) % (1 << 62)

    def _choose_masked(self, ids: torch.Tensor, seed: int) -> torch.Tensor:
        """mask_prob of the real tokens (not specials) of each row, at least one: (B, S) bool."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        maskable = ids > max(self.specials.as_list())  # the specials are the first ids of the cut vocabulary
        draw = torch.rand(ids.shape, generator=gen, device=self.device)
        at = maskable & (draw < self.options.mask_prob)
        # rows where the draw chose nothing: mask their maskable token with the smallest draw
        empty = ~at.any(1) & maskable.any(1)
        if empty.any():
            first = draw.masked_fill(~maskable, 2.0).argmin(1)
            at[empty, first[empty]] = True
        return at


def ragged(at: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) bool and the values at its True entries (row-major) -> positions (B, K) and values (B, K),
    K = the most True entries of a row, padded with NO_POSITION and 0."""
    counts = at.sum(1)
    k = int(counts.max()) if len(counts) else 0
    slot = torch.arange(k, device=at.device)[None, :] < counts[:, None]  # (B, K): which slots are used
    positions = torch.full(slot.shape, NO_POSITION, dtype=torch.long, device=at.device)
    padded = torch.zeros(slot.shape, dtype=values.dtype, device=at.device)
    positions[slot] = at.nonzero()[:, 1]
    padded[slot] = values
    return positions, padded


class ElectraDiscriminator(_Electra):
    Options = DiscriminatorOptions
    inputs = TOKENS
    # L_D and L_CLM of each micro-batch, summed over the step (divide by micro_batches for the step's mean)
    stats = ("rtd_loss", "clm_loss", "micro_batches")

    def __init__(self, context, options: DiscriminatorOptions):
        super().__init__(context, options)
        self._vocabulary()
        if options.init == "e5-small":
            bert = e5_discriminator(self.vmap, options.max_len)
        else:
            bert = BertModel(options.size.bert(len(self.vmap), options.max_len))
        self.module = Discriminator(bert, pretrained=options.init != "random")
        self.clock, self.ballast = None, None
        if options.device_time > 0:  # the embeddings' output: its backward is the last of the micro-batch
            clock = self.clock = DeviceTime(options.device_time, self.device, f"[stages.{context.name}] device_time")
            bert.embeddings.register_forward_hook(lambda _m, _i, out: clock.wrap(out))
        self._optimise()
        # after the optimiser is built, which never sees it: the runtime all-reduces every trainable gradient
        self.ballast = torch.nn.Parameter(torch.zeros(options.sync_numel, device=self.device)) \
            if options.sync_numel else None

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        weights = super().trainable()
        return weights if self.ballast is None else {**weights, "sync_ballast": self.ballast}

    @classmethod
    def choose_ranks(cls, job: JobConfig, name: str, most: int) -> tuple[int, dict]:
        """ranks = "auto" (nebula.runtime.autoranks): n from a warm-up of the generators and one sub."""
        return measure(job, name, most)

    def check(self, inputs: dict[str, torch.Tensor], where: str) -> tuple[torch.Tensor, ...]:
        """The received ids as (tokens (B, S), masked (B, S) bool, originals (B, S)), or a DataError saying
        what is wrong (the runtime sends it to the generator): never an index error."""
        tokens, positions, originals = inputs["tokens"].long(), inputs["positions"].long(), inputs["originals"].long()
        if tokens.dim() != 2 or positions.dim() != 2 or positions.shape != originals.shape \
                or len(positions) != len(tokens):
            raise DataError(f"{where}: tokens {tuple(tokens.shape)}, positions {tuple(positions.shape)} and originals "
                            f"{tuple(originals.shape)}: expected (B, S), (B, K) and (B, K)")
        vocab, (rows, width) = len(self.vmap), tokens.shape
        if width > self.module.bert.cfg.max_positions:
            raise DataError(f"{where}: sequences of {width} tokens, the discriminator has "
                            f"{self.module.bert.cfg.max_positions} positions: set the same max_len on every stage")
        used = positions != NO_POSITION
        for name, x in (("tokens", tokens), ("originals", originals[used])):
            bad = (x < 0) | (x >= vocab)
            if bad.any():
                raise DataError(f"{where}: {int(bad.sum())} {name} outside the vocabulary of {vocab} ids (e.g. "
                                f"{int(x[bad][0])}): every stage must use the same vocabulary (vocab_corpora)")
        bad = used & ((positions < 0) | (positions >= width))
        if bad.any():
            raise DataError(f"{where}: masked position {int(positions[bad][0])} outside sequences of {width} tokens")
        row = torch.arange(rows, device=tokens.device)[:, None].expand_as(positions)
        at = torch.zeros_like(tokens, dtype=torch.long).index_put_((row[used], positions[used]),
                                                                   torch.ones_like(positions[used]), accumulate=True)
        if (at > 1).any():
            raise DataError(f"{where}: a masked position is listed twice in one sequence")
        at = at.bool()
        if (at & (tokens == self.specials.pad)).any():
            raise DataError(f"{where}: a masked position lies in a sequence's padding, past its end")
        full = tokens.clone()  # an original of SAME: the generator sampled the token that was there
        full[row[used], positions[used]] = torch.where(originals[used] == SAME, tokens[row[used], positions[used]],
                                                       originals[used])
        return tokens, at, full

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        if self.clock is not None:
            self.clock.start()
        tokens, at, originals = self.check(inputs, f"step {batch.step} micro-batch {batch.micro_batch} on "
                                                   f"{batch.link}")
        real = tokens != self.specials.pad
        # gamma = 0: no corrective LM at all; its 29k-way head is most of a small D's compute
        with_clm = self.options.clm_weight > 0
        rtd, clm = self.module(tokens, real, at if with_clm else torch.zeros_like(at))
        loss = discriminator_loss(rtd, clm if with_clm else None, tokens, originals, at, real,
                                  self.options.rtd_weight, self.options.clm_weight)
        stats = {"rtd_loss": float(loss.rtd.detach()), "clm_loss": float(loss.clm.detach()), "micro_batches": 1.0}
        return Output(loss=loss.total, stats=stats)

    def pooled(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """Mean-pooled last-layer states of `texts` (N, H): what the evaluations compare."""
        out = []
        self.module.eval()
        for i in range(0, len(texts), batch_size):
            rows = data.to_model_ids(self.vmap, data.encode(self.tok, texts[i:i + batch_size]))
            rows = [[self.specials.bos, *r[:self.options.max_len - 2], self.specials.eos] for r in rows]
            ids = pad_rows(rows, self.specials.pad).to(self.device)
            out.append(self.module.pooled(ids, ids != self.specials.pad).float().cpu())
        return torch.cat(out)
