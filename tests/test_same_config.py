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
