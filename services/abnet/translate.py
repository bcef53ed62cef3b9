"""`nebula translate`: cross-site inference with a trained job: encode here, decode at site b.

From a file (or piped stdin) every sentence goes in one pass, batched; at a terminal (or with
`--interactive`) each line is translated as soon as it is typed, the sites staying up in between.
Either way: one line out per line in, an empty line for an empty one.
"""
from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from nebula.errors import ConfigError
from services.abnet.demo import DEFAULT_JOB

IDLE_PING_S = 60.0  # while nobody types: an empty pass keeps the decoder's peer timeout (300 s) away
PROMPT = "es> "


def register(sub) -> None:
    parser = sub.add_parser("translate", help="translate sentences with a trained two-site job: encode at "
                            "the first stage's site, decode at the second's")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"),
                        help="a run made by `nebula demo` (keys, site configs, checkpoints)")
    parser.add_argument("--job", type=Path, default=None,
                        help="job file (default: the run's own job.toml, else deploy/jobs/abnet-es-en.toml)")
    parser.add_argument("--input", default="-", help="one source sentence per line (default: stdin)")
    parser.add_argument("--interactive", action="store_true",
                        help="translate each line as it arrives (the default at a terminal)")
    parser.set_defaults(func=translate)


def translate(args) -> int:
    interactive = args.interactive or (args.input == "-" and sys.stdin.isatty())
    if interactive and args.input != "-":
        raise ConfigError("--interactive reads stdin: leave out --input")
    if interactive:
        print(f"nebula translate: starting the sites of {args.run_dir} ...", file=sys.stderr, flush=True)
        return serve(args, typed_lines())
    text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text(encoding="utf-8")
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        raise ConfigError("nothing to translate: give one sentence per line")
    return serve(args, iter([lines]))


def typed_lines() -> Iterator[list[str]]:
    """One-line batches from stdin as they are typed; [] after IDLE_PING_S of silence; ends at EOF."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line.rstrip("\n"))
        lines.put(None)
    threading.Thread(target=read, daemon=True, name="stdin").start()
    prompt = sys.stdin.isatty()
    while True:
        if prompt:
            print(PROMPT, end="", file=sys.stderr, flush=True)
        try:
            line = lines.get(timeout=IDLE_PING_S)
        except queue.Empty:
            prompt = False  # the prompt is still on screen
            yield []
            continue
        if line is None:
            return
        prompt = sys.stdin.isatty()
        yield [line]


def serve(args, batches: Iterator[list[str]]) -> int:
    """Start site b's services, run the encoder here, translate each batch as one evaluation pass."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import load_job
    from nebula.site.local import interrupted_by_sigterm

    job_file = args.job or (args.run_dir / "job.toml" if (args.run_dir / "job.toml").exists() else DEFAULT_JOB)
    job = load_job(job_file)
    driver = job.graph.coordinator
    if not (args.run_dir / f"site-{job.stage(driver).site}.toml").exists():
        raise ConfigError(f"{args.run_dir} has no site configs: run `nebula demo --run-dir {args.run_dir}` first")
    with interrupted_by_sigterm():
        return _serve(args, job, job_file, driver, batches)


def _serve(args, job, job_file: Path, driver: str, batches: Iterator[list[str]]) -> int:
    # why here: torch, pynacl, kept off `nebula --help`
    from nebula.runtime.service import build_stage, make_runner
    from nebula.site.channel import open_channel
    from nebula.site.config import load_site_config
    from nebula.site.local import start_sites
    from services.abnet.stages import INPUT_SPLIT, single

    group = start_sites(args.run_dir, job_file, skip=(driver,), keys=False)
    try:
        stage = build_stage(job, driver, args.run_dir / driver, quiet=True)
        site = load_site_config(args.run_dir / f"site-{job.stage(driver).site}.toml")

        def answer(runner) -> None:
            done = 0
            for lines in batches:
                stage.add_input(lines, first=done)
                runner.forget_examples(INPUT_SPLIT)
                wanted = [i for i, line in enumerate(lines) if line.strip()]
                scores = runner.evaluate(INPUT_SPLIT, wanted, stage.options.eval_batch_size)
                out = dict(zip(wanted, single(scores)["translations"]))
                for i in range(len(lines)):
                    print(out.get(i, ""), flush=True)
                done += len(lines)

        with open_channel(site, job.stage(driver).address) as channel:
            runner = make_runner(job, driver, stage, channel)
            try:
                runner.run(hook=answer, train=False)
            finally:
                runner.close()
    finally:
        group.stop()
    return 0
