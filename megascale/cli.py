"""`megascale <verb>`: the command line.

Verbs: train, generate, preprocess, tokenizer train, plan. Every verb reports user mistakes
(`UserError`: a bad config field, path, dataset, tokenizer or checkpoint) as one line on
stderr and exits with code 2; anything else is a bug and keeps its traceback.

`megascale train --nproc N ...` checks the config (layout included) here, then starts N
workers through torch's elastic launcher, each running `megascale train ...` as torchrun
would; `torchrun --nproc-per-node N -m megascale train ...` is the same job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

from megascale.errors import CollectiveFailed, UserError

_FOLLOWER_EXIT_DELAY_S = 5.0


def _default_config(overrides: list[str]) -> list[str]:
    """`megascale train` without --config: the CPU default, its data paths found from any directory."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    default = root / "configs" / "cpu_default.toml"
    if not default.is_file():
        raise UserError("--config: no config given and the CPU default (configs/cpu_default.toml of the "
                        "megascale checkout) is not installed here; pass --config FILE")
    given = {o.split("=", 1)[0].strip() for o in overrides}
    extra = [f"{name}={json.dumps(str(root / rel))}" for name, rel in
             (("data.source", "data/shakespeare"), ("data.path", "data/cache/shakespeare"))
             if name not in given and not Path(rel).exists()]
    return [str(default), *extra]


def _cmd_train(args: argparse.Namespace) -> int:
    from megascale.config import check_world_size, load_config

    if args.config is None:
        args.config, *extra = _default_config(args.overrides)
        args.overrides = [*extra, *args.overrides]
    cfg = load_config(args.config, args.overrides)  # validates the layout too, before any process starts
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if args.nproc is not None:
        if "LOCAL_RANK" in os.environ:
            raise UserError("--nproc: this process was started by a launcher (torchrun) already; "
                            "give the number of processes to one of them only")
        check_world_size(cfg, args.nproc, "--nproc")
        if args.nproc > 1:
            from megascale.distributed.launch import launch_local

            return launch_local(args.nproc, _worker_argv(args), prefork_workers=cfg.fault.prefork_workers)
    else:
        check_world_size(cfg, launched, "the number of processes (WORLD_SIZE)")
    from megascale.distributed.init import shutdown_distributed
    from megascale.train import Trainer

    resume = True if args.resume else (False if args.no_resume else None)
    trainer = None
    try:
        trainer = Trainer(cfg, resume=resume)
        result = trainer.fit()
        main = trainer.is_main  # in a parallel run only global rank 0 prints
        if main:
            val = result["val_loss"]
            val_text = (f"val loss {val:.4f} (ppl {math.exp(val):.2f})" if math.isfinite(val)
                        else "no validation")
            if result["steps_run"] == 0 and not result["interrupted"]:  # the same command once more
                print(f"done: the run is at step {result['steps']} of train.steps={cfg.train.steps}; "
                      "nothing to train (raise train.steps to train on)")
            else:
                print(f"done: {result['steps']} steps, train loss {result['train_loss']:.4f}, {val_text}, "
                      f"{result['tokens_per_s']:,.0f} tok/s (median), MFU {100 * result['mfu']:.1f}%, "
                      f"{result['seconds']:.0f}s")
        if result["interrupted"]:
            return 128 + result["stop_signal"]  # the shell convention for "stopped by a signal"
        if cfg.log.sample_tokens:
            from megascale.generate import sample_text

            model = trainer.full_model()  # gathered from the ranks in a parallel run (collective)
            if main:
                text = sample_text(model, trainer.tokenizer, cfg.log.sample_prompt, cfg.log.sample_tokens,
                                   temperature=0.8, top_k=50, seed=cfg.train.seed)
                print(f"--- sample ({cfg.log.sample_tokens} tokens from {cfg.log.sample_prompt!r}) ---\n"
                      f"{text}\n---")
        return 0
    except BaseException:
        if trainer is not None:  # the error that ended the run is the one to report, not one of closing
            with contextlib.suppress(Exception):
                trainer.close()
            trainer = None
        raise
    finally:
        # The trainer's threads (heartbeat, trace writer, checkpoint pools) end here, not at interpreter
        # exit: a daemon thread caught inside a torch call then (a heartbeat's store.set) is unwound
        # through C++ and aborts the process ("terminate called without an active exception", SIGABRT)
        # after a run that had finished.
        if trainer is not None:
            trainer.close()
        shutdown_distributed()


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The `train` command line of each worker: this one without --nproc."""
    argv = ["train"]
    if args.config:
        argv += ["--config", args.config]
    if args.resume:
        argv.append("--resume")
    if args.no_resume:
        argv.append("--no-resume")
    return [*argv, *args.overrides]


def _cmd_generate(args: argparse.Namespace) -> int:
    from megascale.generate import generate_from_run

    print(generate_from_run(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                            args.top_k, args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megascale", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("train", help="train a model from a config")
    p.add_argument("--config", help="TOML config file (configs/*.toml; default: configs/cpu_default.toml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="resume; fail if there is no checkpoint")
    g.add_argument("--no-resume", action="store_true", help="start fresh even if a checkpoint exists")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="start N local processes (torchrun's launcher) for a parallel layout: "
                        "N must equal parallel.tp * parallel.pp * parallel.dp")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("--checkpoint", required=True, help="run directory (or one checkpoint directory in it)")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="> 0 samples; 0 decodes greedily")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (k >= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_generate)

    # Each area owns its verbs; these imports are light (no torch).
    from megascale.checkpoint.cli import register as register_export
    from megascale.data.cli import register as register_data
    from megascale.fault.cli import register as register_launch
    from megascale.observe.cli import register as register_observe
    from megascale.perf.cli import register as register_plan

    register_data(sub)
    register_plan(sub)
    register_export(sub)
    register_observe(sub)
    register_launch(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come before or after options (`train --config x a=b --resume c=d`):
    # argparse stops collecting a positional list at the first option, so gather the rest.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except UserError as e:
        # In a parallel job every rank raises the same user error (the ranks agree on them): the
        # first rank of each host says it, once in each host's log (a host's own log is where its
        # operator looks, and the host that differs is often not rank 0's).
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"megascale {args.verb}: error: {e}", file=sys.stderr, flush=True)
        else:
            # Let the host's first rank exit first: its launcher stops the host's other workers as soon
            # as one exits with an error, and that rank must not be stopped before it has said why.
            time.sleep(_FOLLOWER_EXIT_DELAY_S)
        from megascale.fault.inject import delays

        time.sleep(delays(int(os.environ.get("RANK", "0"))).get("exit", 0.0))  # tests: a slow teardown
        return e.exit_code
    except CollectiveFailed:
        # the rank said what failed, where, and where its stacks are (observe/watchdog.py): a traceback
        # from each rank of the job would only bury those lines. Exit 1: a crash, which a launcher restarts
        return 1
    except KeyboardInterrupt:
        print(f"megascale {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
