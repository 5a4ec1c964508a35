"""`megascale timeline | report | diagnose RUN_DIR`: the run's traces, as a timeline, a report, a verdict."""

from __future__ import annotations

import argparse
from pathlib import Path

from megascale.errors import UserError

TIMELINE_STEPS = 50  # the steps `megascale timeline` shows by default, the newest


def register(subparsers) -> None:
    p = subparsers.add_parser("timeline", help="merge every rank's trace into one Chrome/Perfetto trace JSON")
    p.add_argument("run_dir", help="the run directory (its trace/ folder holds rank_NNNNN.jsonl)")
    p.add_argument("-o", "--out", help="output file (default: RUN_DIR/timeline.json)")
    p.add_argument("--group-by", default="rank", choices=("rank", "dp", "pp", "tp"),
                   help="order and label the ranks by this mesh coordinate")
    p.add_argument("--steps", help=f"steps A:B (inclusive, 0-based optimizer steps), or all (default: the "
                   f"newest {TIMELINE_STEPS}: a long run's whole trace is more than a browser opens)")
    p.set_defaults(func=_cmd_timeline)

    from megascale.observe import diagnose, report

    report.add_parser(subparsers)
    diagnose.register(subparsers)


def _cmd_timeline(args: argparse.Namespace) -> int:
    from megascale.observe.timeline import write_timeline
    from megascale.observe.trace import p2p_pairs, read_run, step_window

    if not Path(args.run_dir).is_dir():
        raise UserError(f"{args.run_dir}: not a directory")
    try:
        steps = step_window(args.run_dir, args.steps, TIMELINE_STEPS)
        ranks = read_run(args.run_dir, steps=steps)
        n = sum(len(t.events) for t in ranks.values())
        if n == 0 and steps is not None:
            raise ValueError(f"--steps: the traces in {args.run_dir} hold no events of steps "
                             f"{steps[0]}-{steps[1]}")
        out = write_timeline(args.run_dir, args.out, args.group_by, steps, ranks)
    except ValueError as e:
        raise UserError(str(e)) from None
    err = max((t.clocks[-1]["err_ns"] for t in ranks.values() if t.clocks), default=0)
    which = "every step" if steps is None else f"steps {steps[0]}-{steps[1]}"
    print(f"{out}: {n} spans of {len(ranks)} ranks, {which}; clock offsets to rank 0 known within "
          f"{err / 1e3:.1f} us")
    lat = alignment_latencies(p2p_pairs(ranks))
    if lat:
        lat.sort()
        print(f"  p2p check: {len(lat)} receives that waited end {lat[len(lat) // 2] / 1e3:.1f} us (median) "
              f"after their send began (min {lat[0] / 1e3:.1f} us; < 0 would mean misaligned clocks)")
    print("  open it at https://ui.perfetto.dev (Open trace file), or chrome://tracing")
    return 0


def alignment_latencies(pairs) -> list[int]:
    """For receives that were waiting when the data was sent: recv end - send start (ns). On aligned
    clocks this is the transfer latency, small and never negative; a clock error shows up 1:1 in it."""
    return [rv.t1 - s.t0 for s, rv, _, _ in pairs if rv.blocked > 0 and rv.t0 <= s.t0]
