"""`nebula electra eval`: D untrained against D pre-trained on the held-out evaluations, over seeds.

    nebula electra eval --job RUN/job.toml --corruptor RUN/generator-mlm/generator/checkpoints/step-00000800.pt \
        --run RUN/one-site/disc/checkpoints/step-00000000.pt RUN/two-site/disc/checkpoints/step-00000300.pt \
        --run ...   # one --run (untrained, pre-trained) per training seed

The job names the stages (their sizes, vocabulary and data); every D is scored on the same sequences,
corrupted once by the corruptor with --seed (services/electra/compare.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from nebula.errors import ConfigError

UNTRAINED_AS_BUILT = "built"  # in place of a step-0 checkpoint: D as the job builds it (its seeded init)


def register(sub) -> None:
    # why the defaults are literals: `nebula --help` imports this module, and compare.py imports torch
    parser = sub.add_parser("electra", help="ELECTRA-Cloud: evaluate discriminators on held-out data")
    actions = parser.add_subparsers(dest="action", required=True)
    ev = actions.add_parser("eval", help="D untrained vs pre-trained: RTD AUC and accuracy, CLM, alignment (and "
                                         "against a shared-token baseline), G's MLM accuracy, with paired "
                                         "bootstrap intervals over items and t intervals over seeds")
    ev.add_argument("--job", type=Path, required=True, help="the job file the checkpoints were trained with")
    ev.add_argument("--corruptor", type=Path, default=None, metavar="CHECKPOINT",
                    help="generator checkpoint that corrupts the held-out text for every D (default: the "
                         "generator as the job builds it, i.e. its `init`)")
    ev.add_argument("--run", nargs=2, action="append", required=True, metavar=("UNTRAINED", "PRETRAINED"),
                    help=f"D's checkpoints of one training seed: step 0 (or {UNTRAINED_AS_BUILT!r}) and the "
                         "pre-trained one; repeat per seed")
    ev.add_argument("--seed", type=int, default=0, help="of the corruption, the held-out samples, the bootstrap")
    ev.add_argument("--sequences", type=int, default=256, help="held-out sequences corrupted (default 256)")
    ev.add_argument("--pairs", type=int, default=4000, help="translation pairs of the alignment test (default 4000)")
    ev.add_argument("--split", choices=("test", "valid"), default="test",
                    help="held-out split: valid where a setting is chosen, test where it is reported (default test; "
                         "retrieval and the probe read test only)")
    ev.add_argument("--no-encoder-evals", action="store_true", help="leave out retrieval and the probe")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(func=run_eval)
    from services.electra.seeds import register as register_seeds  # why here: it imports the demo's module
    register_seeds(actions)


def run_eval(args) -> int:
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import load_job
    from services.electra.compare import Setting, evaluate_runs, format_encoder, format_rows
    if args.sequences < 2 or args.pairs < 2:
        raise ConfigError("--sequences and --pairs must be at least 2 (a bootstrap needs two items)")
    runs = [(None if before == UNTRAINED_AS_BUILT else Path(before), Path(after)) for before, after in args.run]
    setting = Setting(load_job(args.job), args.corruptor, args.seed, args.sequences, args.pairs,
                      not args.no_encoder_evals, args.split)
    result = evaluate_runs(setting, runs)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print(format_rows(result))
    if setting.encoder_evals and setting.split == "test":
        print(f"\nretrieval and the probe (not targets; docs/electra.md, \"Evaluation\"):\n{format_encoder(result)}")
    return 0
