"""Every rank checks at start-up that it runs rank 0's config (distributed/same_config.py): hosts
launched one by one can differ (a stale file, an override on one node), and no collective would say so
clearly (a size mismatch, a hang, or silently diverging replicas)."""

from __future__ import annotations

from _dist import one_thread_fixture, pools_fixture  # noqa: F401 - the fixtures are found by their names


def _check(rank: int, overrides: list[list[str]]) -> str | None:
    from megascale.config import ConfigError, load_config
    from megascale.distributed.same_config import check_same_config

    try:
        check_same_config(load_config(None, overrides[rank]), rank, len(overrides))
    except ConfigError as e:
        return str(e)
    return None


def test_a_field_that_differs_is_named_on_every_rank(pools):
    pool = pools(2)
    assert pool.run(_check, [[], []]) == [None, None]
    # where a host keeps its copy of the data and its snapshots is its own business
    local = [["data.path=/a/ds"], ["data.path=/b/ds", "data.source=/b/src", "checkpoint.memory_dir=/b/shm"]]
    assert pool.run(_check, local) == [None, None]
    said = pool.run(_check, [["optim.lr=0.002"], ["optim.lr=0.01", "model.d_model=96", "train.steps=7"]])
    assert said[0] == said[1], said  # every rank raises the same error, so all of them stop here
    assert said[0].startswith("the ranks' configs differ: rank 1 (host "), said[0]
    assert "1 of 2 ranks differ from rank 0" in said[0], said[0]
    assert ("model.d_model = 96 there, 384 on rank 0; optim.lr = 0.01 there, 0.002 on rank 0; "
            "train.steps = 7 there, 1000 on rank 0." in said[0]), said[0]
    assert said[0].endswith("(only data.path, data.source, checkpoint.memory_dir may differ)"), said[0]
    four = pool.run(_check, [[], ["train.seed=1", "train.steps=2", "optim.lr=1.0", "model.n_layers=1"]])
    assert "(and 1 more)" in four[0], four[0]


def _check_launched(rank: int, launched: list[tuple[str, str]]) -> str | None:
    """_check of the default config on a rank whose `megascale launch` had (--nnodes as MIN:MAX,
    --nproc-per-node), as the agent and elastic leave them in its environment."""
    import os

    from megascale.fault.rendezvous import NNODES_ENV

    os.environ[NNODES_ENV], os.environ["LOCAL_WORLD_SIZE"] = launched[rank]
    try:
        return _check(rank, [[], []])
    finally:
        del os.environ[NNODES_ENV], os.environ["LOCAL_WORLD_SIZE"]


def test_hosts_launched_with_another_nnodes_or_nproc_per_node_are_named(pools):
    """With parallel.dp = 0 no config field differs when one host was started with --nnodes 1:2 and the
    others with 2 (it may train alone in a round of its own); hosts of other --nproc-per-node would
    disagree on the host groups they create (a hang in the self-check). Both are said like a field."""
    pool = pools(2)
    assert pool.run(_check_launched, [("2:2", "2"), ("2:2", "2")]) == [None, None]
    said = pool.run(_check_launched, [("2:2", "2"), ("1:2", "2")])
    assert said[0] == said[1], said
    assert "--nnodes = '1:2' there, '2' on rank 0" in said[0], said[0]
    assert "Launch every host with the same config, overrides, --nnodes and --nproc-per-node" in said[0]
    said = pool.run(_check_launched, [("2:2", "2"), ("2:2", "4")])
    assert "--nproc-per-node = 4 there, 2 on rank 0" in said[0], said[0]


def _check_data(rank: int, prefixes: list[list[str]]) -> str | None:
    """check_same_data on rank's datasets (a blend when it has several), hosts named h0, h1, ..."""
    from megascale.data.megatron import open_dataset
    from megascale.distributed.same_config import check_same_data
    from megascale.errors import UserError

    mine = prefixes[rank]
    fields = ["data.path"] if len(mine) == 1 else [f"data.blend[{i}]" for i in range(len(mine))]
    try:
        check_same_data([(f, open_dataset(p)) for f, p in zip(fields, mine, strict=True)], rank,
                        [f"h{r}" for r in range(len(prefixes))])
    except UserError as e:
        return str(e)
    return None


def _write(prefix, docs) -> str:
    import numpy as np

    from megascale.data.indexed import encode_index

    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".bin").write_bytes(np.concatenate(docs).astype("<u2").tobytes())
    offsets = np.r_[0, np.cumsum([len(d) for d in docs])]
    prefix.with_suffix(".idx").write_bytes(encode_index(np.dtype("<u2"), 257, "byte", offsets))
    return str(prefix)


def test_a_host_whose_copy_of_the_data_differs_is_named_on_every_rank(pools, tmp_path):
    """data.path may differ per host (each its own copy), the tokens may not: replicas reading copies
    that drifted would train on different corpora with nothing failing."""
    import numpy as np

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, int(rng.integers(20, 400))) for _ in range(300)]
    a = _write(tmp_path / "a" / "ds", docs)
    copy = _write(tmp_path / "b" / "ds", docs)  # another host's copy, another path
    shorter = _write(tmp_path / "c" / "ds", docs[:-1])  # a copy from an older dump
    retokenised = _write(tmp_path / "d" / "ds", [(d + 1) % 256 for d in docs])  # same sizes
    pool = pools(2)
    assert pool.run(_check_data, [[a], [copy]]) == [None, None]
    said = pool.run(_check_data, [[a], [shorter]])
    assert said[0] == said[1], said  # every rank raises the same error, so all of them stop here
    n = sum(len(d) for d in docs)
    assert said[0].startswith(
        f"data.path: rank 1 (host h1) reads other data than rank 0 (host h0): {shorter} there (299 "
        f"documents, {n - len(docs[-1]):,} tokens), {a} on rank 0 (300 documents, {n:,} tokens); 1 of 2 "
        "ranks differ."), said[0]
    said = pool.run(_check_data, [[a], [retokenised]])
    assert f"(300 documents, {n:,} tokens; the same size, other tokens)" in said[0], said[0]
    # a blend names the dataset that differs
    said = pool.run(_check_data, [[copy, a], [copy, shorter]])
    assert said[0].startswith(f"data.blend[1]: rank 1 (host h1) reads other data than rank 0 (host h0): "
                              f"{shorter} there"), said[0]
