"""`data.blend`: the mix by weight over every prefix, a fixed seed-driven order, exact resume (through
the loader's state and through a real checkpoint), the data-parallel split, and its config errors."""

import json

import numpy as np
import pytest
import torch

from megascale.config import ConfigError, DataConfig, load_config
from megascale.data.blend import BlendedSamples, BlendIndex, open_blend
from megascale.data.dataset import open_splits
from megascale.data.ensure import ensure_dataset
from megascale.data.indexed import encode_index, token_dtype
from megascale.data.loader import BatchLoader
from megascale.errors import UserError

SEQ = 8


def _write(prefix, docs, tokenizer="byte", vocab=257):
    """A megascale-format dataset of the given documents (token id lists), written directly."""
    dtype = token_dtype(vocab)
    flat = np.concatenate([np.asarray(d) for d in docs]).astype(dtype)
    offsets = np.r_[0, np.cumsum([len(d) for d in docs])]
    prefix.with_suffix(".bin").write_bytes(flat.tobytes())
    prefix.with_suffix(".idx").write_bytes(encode_index(dtype, vocab, tokenizer, offsets))
    return str(prefix)


def _tagged(prefix, tag, n_docs, seed):
    """Documents whose every token is in [tag*50, tag*50 + 50): a sample says which dataset it is from."""
    rng = np.random.default_rng(seed)
    return _write(prefix, [rng.integers(tag * 50, tag * 50 + 50, int(rng.integers(5, 40)))
                           for _ in range(n_docs)])


@pytest.fixture
def three(tmp_path):
    """Three datasets of very different sizes, and the weights to mix them by."""
    paths = [_tagged(tmp_path / f"ds{i}", i, n, seed=i) for i, n in enumerate((60, 15, 200))]
    return [[0.5, paths[0]], [0.2, paths[1]], [0.3, paths[2]]]


def _cfg(blend, **kw):
    return DataConfig(blend=blend, val_fraction=kw.pop("val_fraction", 0.1), seed=kw.pop("seed", 7), **kw)


def _source(tokens):
    """Which dataset each row of a batch came from (by the token range of _tagged)."""
    tags = np.asarray(tokens) // 50
    assert (tags == tags[:, :1]).all()
    return tags[:, 0]


def _run(loader, steps):
    return [loader.next_batch() for _ in range(steps)]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b, strict=True))


# ---- the index


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.2, 0.3], [1, 2, 3, 4, 5, 6, 7, 100]])
def test_every_prefix_holds_the_mix(weights):
    index = BlendIndex(weights)
    n = 50_000
    d, k = index.lookup(np.arange(n))
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[d], axis=0)  # per prefix, per dataset
    target = np.arange(1, n + 1)[:, None] * index.w
    assert np.abs(counts - target).max() < 0.5 + index.w.max() * len(weights) / 2  # the stated bound
    for j in range(len(weights)):  # each dataset's samples are taken in turn: 0, 1, 2, ...
        assert np.array_equal(k[d == j], np.arange((d == j).sum()))
    # any position is computed on its own, with the same answer as the whole prefix
    probe = np.random.default_rng(0).integers(0, n, 300)
    assert all(np.array_equal(a, b[probe]) for a, b in zip(index.lookup(probe), (d, k), strict=True))
    far = index.lookup(np.arange(10**12, 10**12 + 1000))[0]
    assert np.abs(np.bincount(far, minlength=len(weights)) / 1000 - index.w).max() < 0.01


def test_measured_mix_of_a_run_is_within_one_percent(three):
    train, _ = open_blend(_cfg(three), SEQ)
    loader = BatchLoader(train, 16, seed=7, prefetch=2)
    sources = np.concatenate([_source(x) for x, _ in _run(loader, 60)])  # 960 samples
    loader.close()
    mix = np.bincount(sources, minlength=3) / len(sources)
    weights = np.array([0.5, 0.2, 0.3])
    assert np.abs(mix - weights).max() < 0.01, mix
    # dataset 1 is small: the run goes through several of its epochs, each a fresh permutation
    d, idx = train.locate(np.arange(len(sources)))
    n1 = len(train.parts[1])
    firsts = idx[d == 1]
    assert len(firsts) > 2 * n1
    assert sorted(firsts[:n1]) == list(range(n1)) and sorted(firsts[n1 : 2 * n1]) == list(range(n1))
    assert not np.array_equal(firsts[:n1], firsts[n1 : 2 * n1])


# ---- order, resume, data parallel


def test_same_seed_same_order_other_seed_other_order(three):
    a = _run(BatchLoader(open_blend(_cfg(three), SEQ)[0], 8, seed=7, prefetch=0), 10)
    b = _run(BatchLoader(open_blend(_cfg(three), SEQ)[0], 8, seed=7, prefetch=0), 10)
    c = _run(BatchLoader(open_blend(_cfg(three, seed=8), SEQ)[0], 8, seed=8, prefetch=0), 10)
    assert _equal(a, b) and not _equal(a, c)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_from_a_saved_position_is_exact(three, prefetch):
    full = BatchLoader(open_blend(_cfg(three), SEQ)[0], 8, seed=7, prefetch=prefetch)
    want = _run(full, 40)
    full.close()
    first = BatchLoader(open_blend(_cfg(three), SEQ)[0], 8, seed=7, prefetch=prefetch)
    got = _run(first, 17)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    first.close()
    assert state["consumed_samples"] == 17 * 8 and state["blend"] == [[0.5, len(first.samples.parts[0])],
                                                                     [0.2, len(first.samples.parts[1])],
                                                                     [0.3, len(first.samples.parts[2])]]
    second = BatchLoader(open_blend(_cfg(three), SEQ)[0], 8, seed=7, prefetch=prefetch)
    second.load_state_dict(state)
    got += _run(second, 23)
    second.close()
    assert _equal(want, got)


def test_data_parallel_ranks_read_their_rows_of_the_same_batch(three):
    train = open_blend(_cfg(three), SEQ)[0]
    whole = _run(BatchLoader(train, 8, seed=7, prefetch=0), 5)
    parts = [_run(BatchLoader(train, 8, seed=7, dp_rank=r, dp_size=4, prefetch=0), 5) for r in range(4)]
    for step in range(5):
        assert torch.equal(torch.cat([p[step][0] for p in parts]), whole[step][0])


def test_a_changed_blend_is_refused_on_resume(three):
    loader = BatchLoader(open_blend(_cfg(three), SEQ)[0], 8, seed=7, prefetch=0)
    _run(loader, 2)
    state = loader.state_dict()
    other = [[0.6, three[0][1]], three[1], three[2]]
    with pytest.raises(UserError, match="data loader state: the checkpoint has blend=.*data.blend"):
        BatchLoader(open_blend(_cfg(other), SEQ)[0], 8, seed=7, prefetch=0).load_state_dict(state)
    single = BatchLoader(open_splits(three[0][1], _cfg([]), SEQ)[0], 8, seed=7, prefetch=0)
    with pytest.raises(UserError, match=r"data.blend: the checkpoint was taken on 3 dataset\(s\), this run"):
        single.load_state_dict(state)


def test_validation_blend_is_fixed_and_mixed(three):
    _, val = open_blend(_cfg(three, val_fraction=0.3), SEQ)
    assert isinstance(val, BlendedSamples) and len(val) > 0
    again = open_blend(_cfg(three, val_fraction=0.3), SEQ)[1]
    assert torch.equal(val.batch(range(12)), again.batch(range(12)))
    _, none = open_blend(_cfg(three, val_fraction=0.0), SEQ)
    assert len(none) == 0


# ---- the config


def test_config_form_and_errors(three, tmp_path):
    blend = json.dumps(three)
    cfg = load_config(None, [f"data.blend={blend}"])
    assert cfg.data.blend == three
    (tmp_path / "c.toml").write_text(cfg.to_toml())  # and back through a file, as config.toml is
    assert load_config(tmp_path / "c.toml").data.blend == three
    bad = [
        ('data.blend="ds"', "data.blend: expected list"),
        ("data.blend=[[0, \"a\"]]", r"data.blend\[0\]: the weight must be > 0, got 0"),
        ("data.blend=[[1, \"a\"], [-2, \"b\"]]", r"data.blend\[1\]: the weight must be > 0, got -2"),
        ("data.blend=[[\"a\", 1]]", r"data.blend\[0\]: must be \[weight, path\]"),
        ("data.blend=[[1]]", r"data.blend\[0\]: must be \[weight, path\]"),
        ("data.blend=[[true, \"a\"]]", r"data.blend\[0\]: must be \[weight, path\]"),
        ("data.blend=[[1, \"\"]]", r"data.blend\[0\]: the path is empty"),
    ]
    for override, problem in bad:
        with pytest.raises(ConfigError, match=problem):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="data.source: .* data.blend replaces"):
        load_config(None, [f"data.blend={blend}", "data.source=corpus/"])


def test_missing_or_mismatched_datasets_name_data_blend(three, tmp_path):
    assert ensure_dataset(_cfg(three)) == ""  # all there: nothing to build
    missing = [three[0], [1.0, str(tmp_path / "nope")]]
    with pytest.raises(UserError, match=rf"data.blend\[1\]: {tmp_path / 'nope'}.bin does not exist"):
        ensure_dataset(_cfg(missing))
    other = _write(tmp_path / "gpt2", [[1, 2, 3]], tokenizer="gpt2", vocab=50257)
    with pytest.raises(UserError, match=r"data.blend\[1\]: .*gpt2.idx was built with tokenizer 'gpt2'"):
        ensure_dataset(_cfg([three[0], [1.0, other]]))
    (tmp_path / "gpt2.bin").write_bytes(b"\0")
    with pytest.raises(UserError, match=r"data.blend\[1\]: .*gpt2.bin: 1 bytes"):
        ensure_dataset(_cfg([three[0], [1.0, other]]))
    tiny = _write(tmp_path / "tiny", [[1, 2]])
    with pytest.raises(UserError, match=r"data.blend\[1\]: the training split of .*tiny.bin has 2 tokens"):
        open_blend(_cfg([three[0], [1.0, tiny]], val_fraction=0.0), SEQ)


# ---- through the Trainer and a real checkpoint


def test_trainer_resumes_a_blend_exactly(three, tmp_path):
    from megascale.train import Trainer

    def tiny(run, *extra):
        return load_config(None, [
            "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=8",
            "train.global_batch=8", "train.micro_batch=4", "train.steps=6", "train.eval_interval=3",
            "train.eval_batches=2", "optim.warmup_steps=1", "log.progress=false", "log.tensorboard=false",
            "log.sample_tokens=0", f"data.blend={json.dumps(three)}", "data.val_fraction=0.2",
            f"train.run_dir={json.dumps(str(tmp_path / run))}", "checkpoint.interval=0",
            "checkpoint.writer_process=false", *extra,
        ])

    full = Trainer(tiny("full"), quiet=True)
    r_full = full.fit()
    first = Trainer(tiny("split"), quiet=True)
    r1 = first.fit(max_steps=4)
    saved = json.loads(next((tmp_path / "split").rglob("COMMIT.json")).read_text())["loader"]
    assert saved == {**first.loader.state_dict(), "consumed_samples": 32}  # the blend's signature too
    assert saved["blend"] == [[w, len(p)] for (w, _), p in zip(three, first.train_samples.parts, strict=True)]
    second = Trainer(tiny("split"), quiet=True)
    assert second.step == 4 and second.restored.extra["loader"] == saved
    assert second.loader.state_dict() == saved
    r2 = second.fit()
    assert r1["losses"] + r2["losses"] == r_full["losses"] and r2["val_loss"] == r_full["val_loss"]
    assert np.isfinite(r_full["losses"]).all()
