"""The resumable batch loader: which samples make up each optimizer step, and loading them.

The data order is a single infinite stream of sample indices: epoch 0's permutation,
then epoch 1's, and so on (a fixed order for validation). Step s takes stream positions
[s*B, (s+1)*B) for global batch B, wherever they fall, so an epoch boundary can lie
inside a batch and no sample is dropped or repeated within an epoch. The only state is
the number of samples consumed (as in Megatron-LM), which is what makes a resumed run
continue bit-for-bit and lets the global batch size change on resume.

The global batch is the same for every parallel layout; a data-parallel rank reads only
its contiguous slice of it (`dp_rank`, `dp_size`), so dp=1 and dp=4 see the same
samples per step.

With `prefetch=N` a background thread loads the next N batches while the caller
computes; it produces exactly the batches the synchronous path would, in order.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from megascale.data.dataset import PackedSamples, epoch_permutation
from megascale.data.fingerprint import datasets_of, describe, fingerprint
from megascale.errors import UserError

# the way to train a checkpoint's weights on other data: a new run from them, its data position at zero
_NEW_RUN = ("to train these weights on other data, export them (megascale export RUN --format hf --output "
            "DIR) and start a new run with model.init_from=hf:DIR")


def _content(held: dict[str, Any]) -> tuple:
    return held["docs"], held["tokens"], held["digest"]


class BatchLoader:
    def __init__(
        self,
        samples: PackedSamples,
        global_batch: int,
        seed: int,
        *,
        shuffle: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
        prefetch: int = 2,
    ) -> None:
        if len(samples) == 0:
            raise UserError(f"data: the {samples.name} split has {samples.num_tokens} tokens, too few for "
                            f"one sample of model.seq_len + 1 = {samples.seq_len + 1}")
        if global_batch < 1 or global_batch % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"global_batch {global_batch} must split evenly over dp_size {dp_size} "
                             f"(dp_rank {dp_rank})")
        self.samples, self.global_batch, self.seed, self.shuffle = samples, global_batch, seed, shuffle
        self.dp_rank, self.dp_size, self.prefetch = dp_rank, dp_size, prefetch
        self.consumed_samples = 0
        self._held: list[dict[str, Any]] | None = None  # what the datasets hold: computed at the first save
        self._perms: dict[int, np.ndarray] = {}  # epoch -> order; a batch spans at most a few epochs
        self._perm_lock = threading.Lock()  # shared by the caller and the prefetch thread
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        # what loading cost this process: rows and bytes read from the dataset, CPU seconds of the thread
        # that read them (the prefetch thread; shared_loader.py's producer), CPU seconds of the caller
        # inside next_batch (with prefetch=0 the reads themselves too); benchmarks/shared_loader.py
        self.stats = {"rows_read": 0, "bytes_read": 0, "load_cpu_s": 0.0, "next_cpu_s": 0.0}

    # ---- order

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.consumed_samples // self.num_samples

    def stream_indices(self, position: int, count: int) -> np.ndarray:
        """Sample indices at stream positions [position, position + count)."""
        pos = np.arange(position, position + count, dtype=np.int64)
        if getattr(self.samples, "self_ordered", False):  # data.blend: it orders its own (blend.py)
            return pos
        within = pos % self.num_samples
        if not self.shuffle:
            return within
        epochs = pos // self.num_samples
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._permutation(int(e))[within[mask]]
        return out

    def global_indices(self, step: int) -> np.ndarray:
        """Sample indices of the whole global batch of `step` (counting from step 0 at this batch size)."""
        return self.stream_indices(step * self.global_batch, self.global_batch)

    def local_slice(self, dp_rank: int | None = None, dp_size: int | None = None) -> slice:
        """The rows of a global batch that data-parallel rank `dp_rank` of `dp_size` trains on."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        size = self.dp_size if dp_size is None else dp_size
        per = self.global_batch // size
        return slice(rank * per, (rank + 1) * per)

    def _permutation(self, epoch: int) -> np.ndarray:
        with self._perm_lock:
            if epoch not in self._perms:
                if len(self._perms) >= 2:
                    del self._perms[min(self._perms)]
                self._perms[epoch] = epoch_permutation(self.num_samples, self.seed, epoch)
            return self._perms[epoch]

    # ---- loading

    def _load(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        # NumPy only: this runs on the prefetch thread, and a torch op there starts a second
        # OpenMP team that competes with the training thread's matmuls for the same cores
        # (measured: +10-25% step time on 2 cores). The main thread wraps the arrays for free.
        c0 = time.thread_time()
        indices = self.stream_indices(position, self.global_batch)[self.local_slice()]
        tokens = np.asarray(self.samples.batch(indices))
        out = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
        self._count_read(len(indices), time.thread_time() - c0)
        return out

    def _count_read(self, rows: int, cpu_s: float) -> None:
        st = self.stats
        st["rows_read"] += rows
        st["bytes_read"] += rows * (self.samples.seq_len + 1) * token_bytes(self.samples)
        st["load_cpu_s"] += cpu_s

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the next step: int64 [global_batch // dp_size, seq_len] each."""
        c0 = time.thread_time()
        if self.prefetch <= 0:
            batch = self._load(self.consumed_samples)
        else:
            if self._thread is None:
                self._start()
            position, batch = take(self._queue, self._thread, "prefetch")
            if isinstance(batch, BaseException):
                self._halt()
                raise batch
            assert position == self.consumed_samples, "prefetch thread out of step"
        self.consumed_samples += self.global_batch
        self.stats["next_cpu_s"] += time.thread_time() - c0
        return torch.from_numpy(batch[0]), torch.from_numpy(batch[1])

    def __iter__(self):
        while True:
            yield self.next_batch()

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        # The thread holds the loader only weakly, so a loader that is dropped without
        # close() is still collected; the finalizer stops the thread then, or at exit
        # (a daemon thread killed inside a torch call at shutdown aborts the process).
        self._thread = threading.Thread(
            target=_produce, args=(weakref.ref(self), self.consumed_samples, self._queue, self._stop),
            name="megascale-data-prefetch", daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_thread, self._stop, self._thread)

    def _halt(self) -> None:
        """Stop the prefetch thread and drop what it loaded (it was for the old position)."""
        if self._thread is not None:
            self._finalizer()
            self._thread = None

    def close(self) -> None:
        self._halt()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state

    def held(self) -> list[dict[str, Any]]:
        """What each dataset the samples read holds (data/fingerprint.py: sizes and a digest, no paths,
        which may move), named by its config field; computed once (milliseconds on any corpus)."""
        if self._held is None:
            self._held = [{"field": field, **fingerprint(ds)} for field, ds in datasets_of(self.samples)]
        return self._held

    def _order(self) -> dict[str, Any]:
        """What the order of samples depends on, beside the data itself."""
        order = {"num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle}
        blend = getattr(self.samples, "blend_signature", None)
        if blend is not None:  # data.blend: the weights and sizes its order depends on (blend.py)
            order["blend"] = blend
        return order

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, **self._order(), "data": self.held()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict`. The sample set and seed must be the ones it was taken with,
        else the order would silently differ; the global batch size may change."""
        if state.get("data") is not None:  # (not for a reset, which gives a position only)
            self._check_same_data(state["data"], self.held())
        mine = self._order()
        for key in ("num_samples", "seed", "shuffle", "blend"):
            if key in state and state[key] != mine.get(key):
                raise UserError(
                    f"data loader state: the checkpoint has {key}={state[key]}, this run {mine.get(key)} "
                    "(data.path, data.blend, data.seed, data.val_fraction or model.seq_len changed since "
                    "it was taken)"
                )
        self._halt()
        self.consumed_samples = int(state["consumed_samples"])

    @staticmethod
    def _check_same_data(then: list[dict[str, Any]], now: list[dict[str, Any]]) -> None:
        """A checkpoint resumes on the tokens it was taken on (one of an older megascale records none).
        The position is a count of samples, so a dataset rebuilt with the same sizes (another tokenizer,
        a newer dump that happens to pack alike) would go on "exactly" over other text, and one of other
        sizes in another order: both silent."""
        if len(then) != len(now):
            raise UserError(f"data.blend: the checkpoint was taken on {len(then)} dataset(s), this run reads "
                            f"{len(now)}; resuming needs the same data ({_NEW_RUN})")
        for was, is_ in zip(then, now, strict=True):
            if _content(was) != _content(is_):
                same = " (the same sizes, other tokens)" if _content(was)[:2] == _content(is_)[:2] else ""
                raise UserError(f"{is_['field']}: holds other data than the checkpoint was taken on: "
                                f"{describe(is_)} now, {describe(was)} then{same}; resuming needs the same "
                                f"tokens ({_NEW_RUN})")

    def reset(self) -> None:
        """Back to the first sample (e.g. to run the same validation batches at every evaluation)."""
        self.load_state_dict({"consumed_samples": 0})


def token_bytes(samples: Any) -> int:
    """Bytes one token id takes in the dataset file (uint16/uint32 memory map); for a blend, its first
    dataset's; 8 (int64) for in-memory samples."""
    parts = getattr(samples, "parts", None)
    if parts:
        samples = parts[0]
    tokens = getattr(getattr(samples, "dataset", None), "tokens", None)
    return int(tokens.dtype.itemsize) if tokens is not None else 8


def _produce(ref: weakref.ref, position: int, out: queue.Queue, stop: threading.Event) -> None:
    """Prefetch thread: load the batches at `position`, `position` + B, ... into `out`."""
    while not stop.is_set():
        loader = ref()
        if loader is None:
            return
        try:
            item: Any = (position, loader._load(position))
        except BaseException as e:  # handed to the caller, which re-raises it
            item = (position, e)
        step = loader.global_batch
        del loader
        put_unless_stopped(out, item, stop)
        if isinstance(item[1], BaseException):
            return
        position += step


def take(out: queue.Queue, thread: threading.Thread, what: str) -> Any:
    """The next item a loader thread queued. Raises if the thread is gone and nothing is left: one that
    died outside its own error handling (which queues the error for the caller) would otherwise leave
    the training step waiting for ever, a hang with nothing in the log."""
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not thread.is_alive() and out.empty():  # alive first: a last item is queued before it ends
                raise RuntimeError(f"data: the loader's {what} thread ({thread.name}) stopped and "
                                   "left no batch") from None


def put_unless_stopped(out: queue.Queue, item: Any, stop: threading.Event) -> None:
    """Hand `item` to the consumer once the queue has room, or give up when `stop` is set (a full queue
    must not keep a prefetch thread alive after its loader is closed)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _stop_thread(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join()
