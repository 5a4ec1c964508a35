"""Every rank of a job must run the same config, read the same data, and every host must see the same
run directory: all three checked once at start-up.

Hosts of a multi-host job are launched one by one (a Slurm script, a pod spec per node), and a stale
config file or an override on one node's command line gives its ranks another config. Nothing else
stops that: another d_model fails in the first gradient exchange with a size mismatch (a restart,
three times over), another train.steps leaves the other hosts waiting for a step that never comes
(a hang), another optim.lr trains on, the dp replicas quietly diverging. Here every rank sends a
digest of its config (one all-gather of a few bytes); only when they differ are the configs
themselves gathered, to say which field differs on which rank and host. The digest covers how the
host was launched too (`megascale launch`'s --nnodes and --nproc-per-node): with parallel.dp = 0 no
config field catches a host launched with another --nnodes (it may close a smaller round than the job's
on its own), and hosts of different --nproc-per-node would not even agree on which groups to create.

A host may keep its own copy of the data (data.path is host-local), but the copies must hold the same
tokens: every rank reads its rows by global sample index, so replicas reading copies that drifted
(an older dump, another tokenisation) train on different corpora and nothing fails. Each rank sends
a digest of its datasets' fingerprints (data/fingerprint.py); only when they differ are the
fingerprints gathered, to name the dataset, the ranks and the sizes.

The run directory (train.run_dir) is the job's, not a host's: the blocklist that tells an evicted
host it is out, the in-flight records a hang's diagnosis reads for every rank, the agents' event
logs and, by default, the checkpoints' storage. On a disk of each host's own (the same path, not a
shared file system) evictions and diagnoses would see one host's part, and a checkpoint would be
split across the hosts' disks: rank 0 writes a file there, and every rank looks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

import torch.distributed as dist

from megascale.config import Config, ConfigError
from megascale.data.fingerprint import describe, fingerprint
from megascale.data.indexed import Documents
from megascale.errors import UserError
from megascale.fault.inject import host_id
from megascale.fault.rendezvous import NNODES_ENV

# Where a host keeps its own copy of something: the path may differ, what it holds may not
# (a host's local dataset cache, its host-memory snapshot directory)
HOST_LOCAL = ("data.path", "data.source", "checkpoint.memory_dir")
SHOWN = 3  # differing fields named in the error


def flat(cfg: Config) -> dict[str, object]:
    """section.field -> value, secrets redacted, the host-local fields left out; under `megascale launch`
    also its --nnodes and --nproc-per-node (elastic's LOCAL_WORLD_SIZE)."""
    out = {f"{section}.{k}": v for section, values in cfg.to_dict().items() for k, v in values.items()}
    out = {k: v for k, v in out.items() if k not in HOST_LOCAL}
    if NNODES_ENV in os.environ:
        lo, _, hi = os.environ[NNODES_ENV].partition(":")
        out["--nnodes"] = lo if lo == hi else f"{lo}:{hi}"
        out["--nproc-per-node"] = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return out


def check_same_config(cfg: Config, rank: int, world_size: int) -> list[str]:
    """Raise a ConfigError, on every rank alike, if any rank's config differs from rank 0's
    (collective; free on one process). Each rank's host."""
    if world_size == 1:
        return [host_id()]
    mine = json.dumps(flat(cfg), sort_keys=True, default=str)
    digests: list[tuple[str, str] | None] = [None] * world_size
    dist.all_gather_object(digests, (hashlib.sha256(mine.encode()).hexdigest(), host_id()))
    if len({d for d, _ in digests}) == 1:
        return [h for _, h in digests]
    configs: list[str | None] = [None] * world_size
    dist.all_gather_object(configs, mine)
    first = json.loads(configs[0])
    other = next(r for r, (d, _) in enumerate(digests) if d != digests[0][0])
    theirs = json.loads(configs[other])
    fields = [k for k in sorted(first.keys() | theirs.keys()) if first.get(k) != theirs.get(k)]
    said = "; ".join(f"{k} = {theirs.get(k)!r} there, {first.get(k)!r} on rank 0" for k in fields[:SHOWN])
    more = f" (and {len(fields) - SHOWN} more)" if len(fields) > SHOWN else ""
    ranks = sum(d != digests[0][0] for d, _ in digests)
    raise ConfigError(
        f"the ranks' configs differ: rank {other} (host {digests[other][1]}; {ranks} of {world_size} ranks "
        f"differ from rank 0, host {digests[0][1]}): {said}{more}. Launch every host with the same config, "
        f"overrides, --nnodes and --nproc-per-node (only {', '.join(HOST_LOCAL)} may differ)")


def check_same_data(datasets: list[tuple[str, Documents]], rank: int, hosts: list[str]) -> None:
    """Raise a UserError, on every rank alike, if any rank's datasets (`datasets`: the config field
    that names each, as data/fingerprint.py's `datasets_of` gives them) hold other tokens than rank
    0's (collective; `hosts`: each rank's; free on one process)."""
    world_size = len(hosts)
    if world_size == 1:
        return
    mine = [(field, str(ds.bin_path)[: -len(".bin")], fingerprint(ds)) for field, ds in datasets]
    digest = hashlib.sha256(json.dumps([fp for _, _, fp in mine]).encode()).hexdigest()
    digests: list[str | None] = [None] * world_size
    dist.all_gather_object(digests, digest)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if not differ:
        return
    everyone: list[list | None] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    other = differ[0]
    (field, path, theirs), (_, path0, first) = next(
        (a, b) for a, b in zip(everyone[other], everyone[0], strict=True) if a[2] != b[2])
    same = "; the same size, other tokens" if describe(theirs) == describe(first) else ""
    raise UserError(
        f"{field}: rank {other} (host {hosts[other]}) reads other data than rank 0 (host {hosts[0]}): "
        f"{path} there ({describe(theirs)}), {path0} on rank 0 ({describe(first)}{same}); {len(differ)} of "
        f"{world_size} ranks differ. Each host's copy of a dataset must hold the same tokens, or the "
        "data-parallel replicas train on different corpora: copy rank 0's files there, or keep the "
        "data on a file system the hosts share")


def check_shared_run_dir(run_dir: Path, rank: int, hosts: list[str]) -> None:
    """Raise a ConfigError, on every rank alike, if a host does not see the run directory rank 0 writes
    to (collective in a job of several hosts, `hosts`: each rank's; nothing to check on one)."""
    if len(set(hosts)) < 2:
        return
    token = None
    if rank == 0:
        probe = run_dir / f".shared-{secrets.token_hex(8)}"  # a new name: no host has it cached as absent
        try:
            probe.touch()
            token = probe.name
        except OSError:  # a full disk: unchecked, as a full disk costs the run's other files
            pass
    box = [token]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return
    seen: list[bool | None] = [None] * len(hosts)
    dist.all_gather_object(seen, (run_dir / box[0]).exists())
    if rank == 0:
        (run_dir / box[0]).unlink(missing_ok=True)
    blind = sorted({hosts[r] for r, sees in enumerate(seen) if not sees})
    if blind:
        raise ConfigError(
            f"train.run_dir {run_dir}: host(s) {', '.join(blind)} do not see the directory rank 0 (host "
            f"{hosts[0]}) writes to. Every host of a job needs the same run directory, on a file system "
            "they share: its blocklist, hang diagnosis, event logs and (checkpoint.path unset) checkpoints "
            "are the job's, not a host's")
