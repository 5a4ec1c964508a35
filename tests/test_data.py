"""Splits, packed samples, the batch loader (order, resume, prefetch, slicing) and ensure_dataset."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megascale.config import DataConfig
from megascale.data.dataset import PackedSamples, epoch_permutation, open_splits, split_documents
from megascale.data.ensure import ensure_dataset
from megascale.data.indexed import IndexedDataset
from megascale.data.loader import BatchLoader
from megascale.data.preprocessing import preprocess
from megascale.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _dataset(tmp_path, n_docs=12, seed=0):
    """Byte-tokenised documents of varied length (some shorter than a sample)."""
    rng = np.random.default_rng(seed)
    texts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(1, 40))))
             for _ in range(n_docs)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([src], tmp_path / "ds", "byte", workers=1, progress=False)
    return IndexedDataset(tmp_path / "ds")


# ---- split


def test_split_is_deterministic_disjoint_and_complete():
    for n, frac in [(100, 0.1), (42, 0.05), (3, 0.5), (2, 0.01), (7, 0.9)]:
        train, val = split_documents(n, frac, seed=5)
        again = split_documents(n, frac, seed=5)
        assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
        assert not set(train) & set(val)
        assert sorted([*train, *val]) == list(range(n))
        assert len(val) == min(max(round(n * frac), 1), n - 1) and len(train) >= 1
        assert list(train) == sorted(train) and list(val) == sorted(val)
    assert not np.array_equal(split_documents(100, 0.1, 5)[1], split_documents(100, 0.1, 6)[1])
    assert len(split_documents(10, 0.0, 1)[1]) == 0
    assert len(split_documents(1, 0.5, 1)[1]) == 0  # one document cannot be on both sides


# ---- packing


@pytest.mark.parametrize("seq_len", [1, 5, 16])
def test_packed_samples_cut_the_concatenated_split(tmp_path, seq_len):
    ds = _dataset(tmp_path)
    docs = [0, 1, 2, 5, 6, 9, 11]  # runs of adjacent documents and gaps
    samples = PackedSamples(ds, docs, seq_len)
    stream = np.concatenate([ds.doc(d) for d in docs]).astype(np.int64)
    assert samples.num_tokens == len(stream)
    assert len(samples) == (len(stream) - 1) // seq_len
    for i in range(len(samples)):
        expected = stream[i * seq_len : i * seq_len + seq_len + 1]
        assert samples[i].dtype == torch.int64
        assert samples[i].tolist() == expected.tolist()
    assert samples.batch([2, 0]).tolist() == [samples[2].tolist(), samples[0].tolist()]
    with pytest.raises(IndexError):
        samples[len(samples)]


def test_open_splits_and_too_short_corpus(tmp_path):
    ds = _dataset(tmp_path)
    train, val = open_splits(tmp_path / "ds", DataConfig(val_fraction=0.25, seed=3), seq_len=8)
    assert len(train.doc_ids) + len(val.doc_ids) == ds.num_docs and len(val.doc_ids) == 3
    assert train.num_tokens + val.num_tokens == ds.num_tokens
    with pytest.raises(UserError, match="too few for one sample of model.seq_len"):
        open_splits(tmp_path / "ds", DataConfig(), seq_len=100_000)


# ---- loader


@pytest.fixture
def samples(tmp_path):
    ds = _dataset(tmp_path, n_docs=30)
    return PackedSamples(ds, np.arange(ds.num_docs), seq_len=4)


def _take(loader, steps):
    return [loader.next_batch() for _ in range(steps)]


def _same(a, b):
    if len(a) != len(b):
        return False
    return all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))


def test_batches_are_shifted_samples_in_epoch_order(samples):
    n = len(samples)
    with BatchLoader(samples, global_batch=8, seed=11, prefetch=0) as loader:
        steps = 2 * n // 8 + 3  # more than two epochs, with batches straddling the boundaries
        got = _take(loader, steps)
    stream = np.concatenate([epoch_permutation(n, 11, e) for e in range(3)])
    for s, (x, y) in enumerate(got):
        assert x.shape == y.shape == (8, 4) and x.dtype == y.dtype == torch.int64
        rows = samples.batch(stream[s * 8 : (s + 1) * 8])
        assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])
    first_epoch = stream[:n]
    assert sorted(first_epoch) == list(range(n))  # every sample once per epoch
    assert not np.array_equal(stream[:n], stream[n : 2 * n])  # and a new order each epoch


def test_loader_is_deterministic_and_seeded(samples):
    a = _take(BatchLoader(samples, 6, seed=1), 5)
    b = _take(BatchLoader(samples, 6, seed=1), 5)
    c = _take(BatchLoader(samples, 6, seed=2), 5)
    assert _same(a, b) and not _same(a, c)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_mid_epoch_equals_uninterrupted(samples, prefetch):
    steps = len(samples) // 6 + 4  # crosses an epoch boundary after resuming
    full = _take(BatchLoader(samples, 6, seed=9, prefetch=prefetch), steps)
    first = BatchLoader(samples, 6, seed=9, prefetch=prefetch)
    head = _take(first, 3)
    state = first.state_dict()
    _take(first, 2)  # the interrupted run went on a little past its checkpoint
    first.close()
    resumed = BatchLoader(samples, 6, seed=9, prefetch=prefetch)
    resumed.load_state_dict(state)
    assert _same(full, head + _take(resumed, steps - 3))
    resumed.close()


def test_prefetch_matches_synchronous_loading(samples):
    sync = _take(BatchLoader(samples, 5, seed=4, prefetch=0), 12)
    with BatchLoader(samples, 5, seed=4, prefetch=2) as loader:
        assert _same(sync, _take(loader, 12))
        loader.load_state_dict({"consumed_samples": 15})  # seeking drops what was prefetched
        assert _same(sync[3:6], _take(loader, 3))


def test_global_indices_and_data_parallel_slices(samples):
    whole = BatchLoader(samples, 8, seed=3, prefetch=0)
    ranks = [BatchLoader(samples, 8, seed=3, dp_rank=r, dp_size=4, prefetch=1) for r in range(4)]
    for step in range(5):
        idx = whole.global_indices(step)
        x, y = whole.next_batch()
        assert torch.equal(x, samples.batch(idx)[:, :-1])
        parts = [r.next_batch() for r in ranks]
        assert all(p[0].shape == (2, 4) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert whole.local_slice(1, 4) == slice(2, 4)
    for r in ranks:
        r.close()


def test_validation_order_is_fixed(samples):
    val = BatchLoader(samples, 4, seed=0, shuffle=False, prefetch=0)
    assert val.global_indices(0).tolist() == [0, 1, 2, 3]
    first = _take(val, 2)
    val.reset()
    assert _same(first, _take(val, 2))


def test_state_from_another_dataset_or_seed_is_refused(samples):
    state = BatchLoader(samples, 4, seed=1).state_dict()
    with pytest.raises(UserError, match="seed=1, this run 2"):
        BatchLoader(samples, 4, seed=2).load_state_dict(state)
    with pytest.raises(UserError, match="num_samples"):
        BatchLoader(samples, 4, seed=1).load_state_dict({**state, "num_samples": 1})


def test_prefetch_thread_errors_reach_the_caller(samples, monkeypatch):
    loader = BatchLoader(samples, 4, seed=1, prefetch=2)

    def broken(indices):
        raise OSError("disk gone")

    monkeypatch.setattr(samples, "batch", broken)
    with pytest.raises(OSError, match="disk gone"):
        loader.next_batch()
    loader.close()


def test_a_prefetch_thread_gone_without_a_word_is_an_error_not_a_hang(samples):
    """A loader thread that ends outside its own error handling (which queues the error) left the step
    waiting on its queue for ever; now next_batch says so once what it queued is taken."""
    import threading

    loader = BatchLoader(samples, 4, seed=1, prefetch=2)
    loader.next_batch()
    loader._stop.set()  # the thread ends without queueing anything more, as a thread that died would
    loader._thread.join()
    outcome: list = []

    def take_all():
        try:
            for _ in range(4):  # what it had queued (at most `prefetch` batches), then the error
                loader.next_batch()
        except RuntimeError as e:
            outcome.append(e)

    t = threading.Thread(target=take_all, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "next_batch still waiting for a thread that is gone"
    assert outcome and "prefetch thread" in str(outcome[0]) and "stopped" in str(outcome[0])
    loader.close()


# ---- ensure_dataset


def test_ensure_builds_from_source_then_reuses(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("to be or not to be")
    cfg = DataConfig(path=str(tmp_path / "cache" / "ds"), source=str(tmp_path / "src"), tokenizer="byte",
                     preprocess_workers=1)
    assert ensure_dataset(cfg, progress=False) == cfg.path
    built = (tmp_path / "cache" / "ds.bin").stat().st_mtime_ns
    assert ensure_dataset(cfg, progress=False) == cfg.path
    assert (tmp_path / "cache" / "ds.bin").stat().st_mtime_ns == built
    assert IndexedDataset(cfg.path).doc(0).tolist() == list(b"to be or not to be") + [256]

    cfg.tokenizer = "gpt2"
    with pytest.raises(UserError, match="data.tokenizer: 'gpt2' differs from 'byte'"):
        ensure_dataset(cfg, progress=False)


def test_ensure_errors_name_the_field(tmp_path):
    cfg = DataConfig(path=str(tmp_path / "x"), source="")
    with pytest.raises(UserError, match=r"data.path: .*x.bin does not exist \(run `megascale preprocess`"):
        ensure_dataset(cfg)
    cfg.source = str(tmp_path / "nowhere")
    with pytest.raises(UserError, match="data.source: .*nowhere does not exist"):
        ensure_dataset(cfg)
    cfg.tokenizer = str(tmp_path / "tok.json")
    with pytest.raises(UserError, match="data.tokenizer: tokenizer file .*tok.json does not exist"):
        ensure_dataset(cfg)


def test_bundled_shakespeare_corpus(tmp_path):
    files = sorted((REPO / "data" / "shakespeare").glob("*.txt"))
    assert len(files) == 42 and not any(f.name.endswith("_gut_f.txt") for f in files)
    stats = preprocess([REPO / "data" / "shakespeare"], tmp_path / "shk", "byte", workers=1, progress=False)
    size = sum(f.stat().st_size for f in files)
    assert (stats.docs, stats.tokens) == (42, size + 42)
    train, val = open_splits(tmp_path / "shk", DataConfig(), seq_len=256)
    assert len(val.doc_ids) == 2 and len(val) > 0 and len(train) > 10_000
