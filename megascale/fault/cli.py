"""`megascale launch`: this host's part of a fault-tolerant job (see fault/driver.py); `megascale rdzv-store`:
its rendezvous store, served outside the job's hosts."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import socket
import sys

from megascale.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run a training job on one or more hosts with automatic restart on faults")
    p.add_argument("--nnodes", default="1", help="hosts in the job: N, or MIN:MAX (default 1)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="worker processes per host")
    p.add_argument("--rdzv-endpoint", default="localhost:0",
                   help="host:port where the hosts meet (the first host's address); every host the same")
    p.add_argument("--rdzv-id", default="",
                   help="the job's id, the same on every host (default: from the endpoint and run_dir)")
    p.add_argument("--local-addr", default=None, help="this host's address as the others reach it")
    p.add_argument("--max-restarts", type=int, default=None, help="default: fault.max_restarts")
    p.add_argument("--unblock", metavar="HOST", default=None,
                   help="take HOST (its --local-addr) off the run's blocklist of evicted hosts, then exit")
    p.add_argument("--config", help="TOML config file (default: configs/cpu_default.toml)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
    p.set_defaults(func=_cmd_launch)

    p = subparsers.add_parser(
        "rdzv-store", help="serve the rendezvous store of `megascale launch` jobs on a host outside them")
    p.add_argument("--bind", default="0.0.0.0", help="the address to listen on (default: every interface)")
    p.add_argument("--port", type=int, default=29400)
    p.set_defaults(func=_cmd_rdzv_store)


def _cmd_rdzv_store(args: argparse.Namespace) -> int:
    """Serve a TCPStore (libuv, many jobs at once) until SIGINT or SIGTERM. A job whose --rdzv-endpoint
    points here has no host it cannot lose: the agent of the endpoint's host otherwise serves the
    store, and evicting that host (a failed self-check, a hang) would end the job."""
    import datetime
    import signal

    import torch.distributed as dist

    if not 0 < args.port < 65536:
        raise UserError(f"--port: {args.port} is not a TCP port")
    try:
        store = dist.TCPStore(args.bind, args.port, is_master=True, wait_for_workers=False, multi_tenant=True,
                              timeout=datetime.timedelta(seconds=60))
    except (RuntimeError, ValueError) as e:
        raise UserError(f"--bind {args.bind} --port {args.port}: cannot listen there ({e})") from None
    print(f"megascale rdzv-store: serving on {args.bind}:{store.port}; jobs use --rdzv-endpoint "
          f"THIS_HOST:{store.port}", flush=True)
    got = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda n, _f: got.append(n))
    while not got:
        signal.pause()
    print(f"megascale rdzv-store: stopped by {signal.Signals(got[0]).name}", flush=True)
    del store
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from megascale.fault import refusal
    from megascale.fault.rendezvous import parse_nnodes

    os.environ[refusal.ENV] = args.rdzv_id  # the agent watches for other hosts' refusals under it
    min_nodes, max_nodes = parse_nnodes(args.nnodes)  # a bad --nnodes is this host's alone to say
    loaded: list = []  # the config, once it loads: a refusal after that waits its rendezvous timeout
    try:
        return _launch(args, min_nodes, max_nodes, loaded)
    except UserError as e:
        if args.unblock is not None or min_nodes < 2 or not args.rdzv_id:
            raise  # without --rdzv-id a store that serves several jobs could not tell whose refusal it is
        # a multi-host job that this host will not join: the hosts waiting for it learn why at once,
        # not as "fewer than N hosts joined" after the rendezvous timeout (fault/refusal.py)
        print(f"megascale launch: error: {e}", file=sys.stderr, flush=True)
        from megascale.config import FaultConfig

        wait = (loaded[0].fault if loaded else FaultConfig()).rendezvous_timeout_s
        print(f"megascale launch: telling the hosts that meet at {args.rdzv_endpoint} why this one will not "
              f"join (for up to {wait:g} s)", file=sys.stderr, flush=True)
        refusal.post(args.rdzv_endpoint, args.rdzv_id, args.local_addr or socket.gethostname(), str(e),
                     min_nodes - 1, wait)
        return e.exit_code


def _launch(args: argparse.Namespace, min_nodes: int, max_nodes: int, loaded: list) -> int:
    from megascale.cli import _default_config
    from megascale.config import check_world_size, load_config
    from megascale.fault.driver import launch

    if args.config is None:
        args.config, *extra = _default_config(args.overrides)
        args.overrides = [*extra, *args.overrides]
    cfg = load_config(args.config, args.overrides)  # a bad config fails here, before any host starts
    loaded.append(cfg)
    if not cfg.checkpoint.resume:
        raise UserError("checkpoint.resume: must stay true under megascale launch (a restart resumes)")
    if args.unblock is not None:
        from megascale.fault import blocklist

        was = blocklist.remove(cfg.train.run_dir, args.unblock)
        print(f"megascale launch: {args.unblock} " + ("is off the blocklist of " if was else "was not on the "
              "blocklist of ") + str(blocklist.path(cfg.train.run_dir)))
        return 0
    if min_nodes != max_nodes and cfg.parallel.dp != 0:
        raise UserError(f"--nnodes {args.nnodes}: a job whose host count may change needs parallel.dp = 0 "
                        f"(data parallel size from the world); parallel.dp = {cfg.parallel.dp} fits one "
                        "count only")
    if cfg.parallel.dp != 0:
        check_world_size(cfg, max_nodes * args.nproc_per_node, "--nnodes x --nproc-per-node")
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            raise UserError(f"--max-restarts: must be >= 0, got {args.max_restarts}")
        cfg.fault.max_restarts = args.max_restarts
    run_id = args.rdzv_id or "megascale-" + hashlib.sha1(
        f"{args.rdzv_endpoint}|{cfg.train.run_dir}".encode()).hexdigest()[:12]
    code = launch(args.nnodes, args.nproc_per_node, args.rdzv_endpoint, run_id,
                  ["--config", args.config, *args.overrides], cfg.fault, args.local_addr,
                  cfg.train.run_dir)
    # No interpreter teardown: after a link fault a rendezvous call abandoned on the dead connection
    # (fault/rendezvous.py) may still be blocked in TCPStore's C++ code on its daemon thread, and the
    # teardown under it aborted the agent once ("terminate called without an active exception",
    # exit -6, after a clean job). The job is over here: streams and log handlers are flushed first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
