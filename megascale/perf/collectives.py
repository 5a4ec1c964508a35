"""Alpha-beta cost of the collectives 3D parallelism uses, per link class.

A message of S bytes over a link costs alpha + S * beta, with alpha the per-message
latency and 1/beta the bandwidth collectives actually reach (`Link.effective_bw`). The
ring algorithms NCCL and gloo use for large messages split the data into n pieces and
take n - 1 steps, each moving S/n bytes through every rank at once:

    all-gather, reduce-scatter   (n-1) * alpha + (n-1)/n * S * beta
    all-reduce                   2 (n-1) * alpha + 2 (n-1)/n * S * beta   (reduce-scatter + all-gather)
    point-to-point               alpha + S * beta

S is always the full (unsharded) tensor size. A group is costed at its slowest hop:
if it spans nodes, every ring step crosses an RDMA NIC (rails: one NIC per GPU).
"""

from __future__ import annotations

import math

from megascale.perf.presets import ClusterPreset, Link


def all_gather(size_bytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * size_bytes / link.effective_bw


def reduce_scatter(size_bytes: float, n: int, link: Link) -> float:
    return all_gather(size_bytes, n, link)


def all_reduce(size_bytes: float, n: int, link: Link) -> float:
    """The cheaper of a ring and a (double binary) tree: a tree pays 2 log2(n) latencies instead of
    2 (n - 1), which is what NCCL picks for small messages such as the global grad norm."""
    if n <= 1:
        return 0.0
    ring = 2.0 * all_gather(size_bytes, n, link)
    tree = 2.0 * math.ceil(math.log2(n)) * link.latency_s + 2.0 * size_bytes / link.effective_bw
    return min(ring, tree)


def p2p(size_bytes: float, link: Link) -> float:
    return link.latency_s + size_bytes / link.effective_bw


def group_link(preset: ClusterPreset, stride: int, size: int) -> Link:
    """The link a group of `size` ranks spaced `stride` apart in the global rank order uses.

    Ranks are numbered node by node, so the group stays inside one node only when its whole
    span (stride * size consecutive ranks, aligned) fits in a node.
    """
    return preset.intra if stride * size <= preset.devices_per_node else preset.inter


def hop_link(preset: ClusterPreset, rank_a: int, rank_b: int) -> Link:
    """The link between two ranks: NVLink-class if they share a node, RDMA otherwise."""
    same = rank_a // preset.devices_per_node == rank_b // preset.devices_per_node
    return preset.intra if same else preset.inter
