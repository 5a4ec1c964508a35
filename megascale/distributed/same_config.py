"""Every rank of a job must run the same config: checked once at start-up, before any work.

Hosts of a multi-host job are launched one by one (a Slurm script, a pod spec per node), and a stale
config file or an override on one node's command line gives its ranks another config. Nothing else
stops that: another d_model fails in the first gradient exchange with a size mismatch (a restart,
three times over), another train.steps leaves the other hosts waiting for a step that never comes
(a hang), another optim.lr trains on, the dp replicas quietly diverging. Here every rank sends a
digest of its config (one all-gather of a few bytes); only when they differ are the configs
themselves gathered, to say which field differs on which rank and host.
"""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from megascale.config import Config, ConfigError
from megascale.fault.inject import host_id

# Where a host keeps its own copy of something: the path may differ, what it holds may not
# (a host's local dataset cache, its host-memory snapshot directory)
HOST_LOCAL = ("data.path", "data.source", "checkpoint.memory_dir")
SHOWN = 3  # differing fields named in the error


def flat(cfg: Config) -> dict[str, object]:
    """section.field -> value, secrets redacted, the host-local fields left out."""
    out = {f"{section}.{k}": v for section, values in cfg.to_dict().items() for k, v in values.items()}
    return {k: v for k, v in out.items() if k not in HOST_LOCAL}


def check_same_config(cfg: Config, rank: int, world_size: int) -> None:
    """Raise a ConfigError, on every rank alike, if any rank's config differs from rank 0's
    (collective; free on one process)."""
    if world_size == 1:
        return
    mine = json.dumps(flat(cfg), sort_keys=True, default=str)
    digests: list[tuple[str, str] | None] = [None] * world_size
    dist.all_gather_object(digests, (hashlib.sha256(mine.encode()).hexdigest(), host_id()))
    if len({d for d, _ in digests}) == 1:
        return
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
        f"differ from rank 0, host {digests[0][1]}): {said}{more}. Launch every host with the same config "
        f"and overrides (only {', '.join(HOST_LOCAL)} may differ)")
