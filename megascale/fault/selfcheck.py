"""Self-check diagnostics: is this host fit to train? Run before each (re)start and on demand.

A host with a bad core, flaky memory or a slow link does not crash: it computes wrong numbers
(the loss diverges a day later) or it is slow (every step waits for it). So before the job
(re)starts every host runs a few checks whose right answer is known in advance, and a host that
fails one is evicted with the reason logged (fault/driver.py does the eviction):

  1 matmul     a product whose exact result is known (small integers, so rounding cannot excuse
               any difference), and its speed against the host's expected speed: the best matmul
               rate recorded for this CPU in megascale.perf.hardware's cache
  2 memory     patterns written into a buffer and read back: 0x00, 0xFF, 0xAA/0x55 alternating
               both ways round, and address-derived words (a stuck, flipped or aliased bit)
  3 allreduce  an all-reduce among this host's ranks of rank-distinct values, checked exactly
  4 p2p        a ring exchange with the neighbours: send to the next rank, receive from the
               previous one, payload checked, bandwidth reported
  5 alltoall   (GPUs) an all-to-all among this host's devices, each block checked

On a GPU the same checks run on each device (NCCL for the collectives). Fault injection for
tests: MEGASCALE_INJECT="fail@selfcheck:N[:rank=R]" makes check number N (above) of global rank R
(every rank without `rank=`) report failure with detail "injected"; unlike the other faults in
fault/inject.py it is not lifted on a restart, because it stands for broken hardware, which a
restart does not mend. The check itself still runs, so the collectives stay matched.

`megascale diagnose --hosts` is `hosts_main`: the local checks here, and under torchrun (RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE set) the collective ones too, one line per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megascale.fault import inject
from megascale.perf import hardware

CHECKS = {1: "matmul", 2: "memory", 3: "allreduce", 4: "p2p", 5: "alltoall"}  # the injection numbers
LABELS = {"allreduce": "host all-reduce", "alltoall": "host all-to-all"}  # how a report line names them


@dataclass
class CheckResult:
    """One check's outcome. `value` is its measured rate in base units (FLOP/s or bytes/s), so the
    driver can also compare hosts with each other; `detail` is the human part of the report line."""

    name: str
    ok: bool
    seconds: float
    detail: str
    value: float | None = None


@dataclass
class SelfCheckReport:
    host: str
    rank: int
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    def line(self) -> str:
        """One line for the log: the failures and why, or every check's figure."""
        head = f"host {self.host} rank {self.rank}: self-check"
        if not self.ok:
            return f"{head} failed: " + "; ".join(f"{_label(r.name)}: {r.detail}" for r in self.failed)
        return f"{head} passed: " + ", ".join(f"{_label(r.name)} {r.detail}" for r in self.results)

    def to_dict(self) -> dict:
        return {"host": self.host, "rank": self.rank, "ok": self.ok,
                "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, d: dict) -> SelfCheckReport:
        return cls(d["host"], d["rank"], [CheckResult(**r) for r in d["results"]])


def _label(name: str) -> str:
    return LABELS.get(name, name)


def _gbs(nbytes: float, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9)


def _fmt_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def _fmt_flops(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- fault injection


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def inject_failure(name: str, rank: int | None = None) -> bool:
    """Whether MEGASCALE_INJECT says check `name` of this rank (or `rank`) is to fail.

    "fail@selfcheck:N[:rank=R][:host=H][:attempt=K]" with N the check's number in CHECKS (1=matmul,
    2=memory, 3=allreduce, 4=p2p, 5=alltoall). Parsed with fault/inject.py's parser; not lifted on restart
    (see the module docstring), so an injected bad host stays bad, as a real one would.
    """
    spec = os.environ.get("MEGASCALE_INJECT")
    if not spec:
        return False
    rank = _rank() if rank is None else rank
    for f in inject._parse(spec):
        if f.action != "fail" or f.point != "selfcheck":
            continue
        if f.value not in CHECKS:
            raise ValueError(f"MEGASCALE_INJECT: fail@selfcheck:{f.value:g}: no such check "
                             f"(known: {', '.join(f'{k}={v}' for k, v in CHECKS.items())})")
        # broken hardware stays broken: every attempt, unless the fault names one (attempt=K)
        if CHECKS[int(f.value)] == name and inject.here(f, rank, default_attempt=None):
            return True
    return False


def _injected(result: CheckResult, rank: int | None = None) -> CheckResult:
    """The result, or a failure with detail "injected" if MEGASCALE_INJECT names this check here."""
    if inject_failure(result.name, rank):
        return CheckResult(result.name, False, result.seconds, "injected", result.value)
    return result


# --------------------------------------------------------------------------- matmul

# Significand bits (with the implicit one) of each dtype: integers up to 2**bits are exact in it.
_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
_DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _exact_operands(n: int, dtype: torch.dtype, seed: int = 0, device=None):
    """(a, b, a @ b as int64), with the product known without a matmul.

    a holds integers in [-2, 2]; b[k, j] = s[k] * c[j] on a band j - w < k <= j (then rows and
    columns shuffled), with s in [-2, 2] and c = +-1. So (a @ b)[i, j] = c[j] * (a sum of w
    consecutive a[i, k] * s[k]): prefix sums, in int64, with no BLAS involved. The band width w
    keeps every partial sum, in whatever order a kernel adds, within the dtype's exact integers
    (4 * w <= 2**bits): dense for fp32 and wider, 64 wide for bf16. Made on `device` (a GPU's n is
    large: 1.4 s for n = 4096 on one CPU core), with its generator, so the operands depend on both.
    """
    device = torch.device(device or "cpu")
    g, on = torch.Generator(device).manual_seed(seed), {"device": device}
    w = min(n, 2 ** _BITS[dtype] // 4)
    a = torch.randint(-2, 3, (n, n), generator=g, **on)
    s = torch.randint(-2, 3, (n,), generator=g, **on)
    c = torch.randint(0, 2, (n,), generator=g, **on) * 2 - 1
    cols = torch.arange(n, **on)
    k, j = cols[:, None], cols[None, :]
    b = torch.where((k <= j) & (k > j - w), s[:, None] * c[None, :], 0)
    prefix = torch.nn.functional.pad(torch.cumsum(a * s, dim=1), (1, 0))
    expected = c * (prefix[:, cols + 1] - prefix[:, (cols - w + 1).clamp(min=0)])
    inner, outer = torch.randperm(n, generator=g, **on), torch.randperm(n, generator=g, **on)
    return a[:, inner].to(dtype), b[inner][:, outer].to(dtype), expected[:, outer]


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matmul under test (a seam for tests to corrupt)."""
    return torch.mm(a, b)


def _mismatch(result: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None if exact, else how far off and where."""
    diff = (result.double() - expected.double()).abs()
    bad = diff.isnan() | (diff > 0)
    if not bool(bad.any()):
        return None
    worst = diff.nan_to_num(nan=float("inf")).argmax().item()
    i, j = divmod(worst, result.shape[1])
    return (f"result off by {diff[i, j].item():.1e} (expected exact) at [{i}, {j}], "
            f"{int(bad.sum())} of {result.numel()} entries wrong")


def _time_products(a, b, expected, device, runs: int) -> tuple[list[float], str | None]:
    """Seconds of each timed run after a warm-up, and the first wrong result's description."""
    wrong = _mismatch(_product(a, b), expected)  # warm-up: BLAS thread pool, kernel choice
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        c = _product(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
        wrong = wrong or _mismatch(c, expected)
    return times, wrong


def _dtype_name(dtype: torch.dtype, device: torch.device) -> str:
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return _DTYPE_NAMES[dtype]


def _rate_key(device: torch.device, name: str, n: int) -> str:
    """The cache key of the expected rate: hardware's own key on a CPU; on a GPU one per part and
    size (the GPU table's peaks are out of reach for a small matmul, so we compare with ourselves)."""
    if device.type == "cpu":
        return hardware._cpu_key(torch, name)
    return f"selfcheck|{torch.cuda.get_device_name(device)}|{name}|n={n}|torch={torch.__version__}"


def _record_rate(device: torch.device, key: str, name: str, rate: float) -> None:
    """Achieved matmul work only ever raises the recorded figure (see hardware.record_matmul_rate)."""
    if device.type == "cpu":
        hardware.record_matmul_rate(name, rate)
    else:
        hardware._update_cache({key: rate})


def _speed_verdict(rate: float, expected: float | None, min_fraction: float) -> tuple[bool, str]:
    if not expected:
        return True, f"{_fmt_flops(rate)} (no reference yet)"
    floor = min_fraction * expected
    if rate < floor:
        return False, (f"too slow: {_fmt_flops(rate)}, expected >= {_fmt_flops(floor)} "
                       f"({min_fraction:g} x the best recorded, {_fmt_flops(expected)})")
    return True, f"{_fmt_flops(rate)} (expected >= {_fmt_flops(floor)})"


def check_matmul(device="cpu", dtype: torch.dtype = torch.float32, n: int = 512, min_fraction: float = 0.5,
                 runs: int = 3, seed: int = 0) -> CheckResult:
    """An n x n x n matmul checked exactly against its known product, and its speed (the median of
    `runs`) against min_fraction x the best rate recorded for this CPU (or GPU part) and dtype.

    With no rate recorded yet it passes on speed ("no reference yet"). The measured rate is recorded
    (it only ever raises the figure) unless the product was wrong, so the next check has a reference.
    """
    device = torch.device(device)
    t0 = time.perf_counter()
    a, b, expected = _exact_operands(n, dtype, seed, device)
    times, wrong = _time_products(a, b, expected, device, runs)
    rate = 2 * n**3 / max(statistics.median(times), 1e-12)
    name = _dtype_name(dtype, device)
    key = _rate_key(device, name, n)
    expected_rate = hardware._read_cache().get(key)  # before this run's figure is added
    if expected_rate and device.type == "cpu":
        expected_rate *= cpu_share()  # the best was one process's; this host's ranks share its cores
    ok, detail = _speed_verdict(rate, expected_rate, min_fraction)
    if wrong:
        ok, detail = False, wrong
    else:  # a wrong product's speed is no reference for anyone
        _record_rate(device, key, name, rate)
    return _injected(CheckResult("matmul", ok, time.perf_counter() - t0, detail, rate))


# --------------------------------------------------------------------------- memory

_PATTERNS = (0x0000000000000000, 0xFFFFFFFFFFFFFFFF, 0xAA55AA55AA55AA55, 0x55AA55AA55AA55AA)
_ADDRESS = "address"  # the word's index in its high half, the index ^ 0x5A5A5A5A in its low half
_CHUNK_WORDS = 1 << 20  # address words are made a chunk at a time: no second buffer-sized array


def _read_back(words):
    """What the verification reads (a seam for tests to flip a bit between write and read)."""
    return words


class _NumpyWords:
    """The CPU buffer, as uint64 words."""

    def __init__(self, nbytes: int):
        self.words = np.empty(nbytes // 8, dtype=np.uint64)

    def _address(self, lo: int, hi: int) -> np.ndarray:
        i = np.arange(lo, hi, dtype=np.uint64)
        return (i << np.uint64(32)) | (i ^ np.uint64(0x5A5A5A5A))

    def write(self, pattern) -> None:
        if pattern != _ADDRESS:
            self.words.fill(pattern)
            return
        for lo in range(0, self.words.size, _CHUNK_WORDS):
            hi = min(lo + _CHUNK_WORDS, self.words.size)
            self.words[lo:hi] = self._address(lo, hi)

    def first_bad(self, pattern) -> tuple[int, int, int] | None:
        """(word index, wrote, read) of the first wrong word, or None."""
        got = _read_back(self.words)
        for lo in range(0, got.size, _CHUNK_WORDS):
            hi = min(lo + _CHUNK_WORDS, got.size)
            want = np.uint64(pattern) if pattern != _ADDRESS else self._address(lo, hi)
            bad = np.flatnonzero(got[lo:hi] != want)
            if bad.size:
                w = lo + int(bad[0])
                return w, int(want if np.ndim(want) == 0 else want[bad[0]]), int(got[w])
        return None


class _TorchWords:
    """A device buffer, as int64 words (torch has no full uint64 arithmetic)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.words = torch.empty(nbytes // 8, dtype=torch.int64, device=device)

    def _want(self, pattern) -> torch.Tensor | int:
        if pattern != _ADDRESS:
            return pattern - (1 << 64) if pattern >= 1 << 63 else pattern  # the same bits, signed
        i = torch.arange(self.words.numel(), dtype=torch.int64, device=self.words.device)
        return (i << 32) | (i ^ 0x5A5A5A5A)

    def write(self, pattern) -> None:
        want = self._want(pattern)
        if isinstance(want, int):
            self.words.fill_(want)
        else:
            self.words.copy_(want)

    def first_bad(self, pattern) -> tuple[int, int, int] | None:
        got, want = _read_back(self.words), self._want(pattern)
        bad = (got != want).nonzero()
        if not bad.numel():
            return None
        w = int(bad[0, 0])
        wrote = want if isinstance(want, int) else int(want[w])
        return w, wrote % (1 << 64), int(got[w]) % (1 << 64)


def _byte_diff(word: int, wrote: int, read: int) -> str:
    """The first differing byte of a wrong word, as 'byte offset B: wrote 0x.. read 0x..'."""
    for k in range(8):  # little-endian: byte k of the word is at offset 8 * word + k
        w, r = (wrote >> 8 * k) & 0xFF, (read >> 8 * k) & 0xFF
        if w != r:
            return f"byte offset {8 * word + k}: wrote {w:#04x}, read {r:#04x}"
    return f"word {word}"


def _pattern_name(pattern) -> str:
    return pattern if pattern == _ADDRESS else f"{pattern & 0xFFFF:#06x}"


def check_memory(mbytes: int = 64, device="cpu") -> CheckResult:
    """Write each pattern into an `mbytes` MiB buffer and read it back (numpy on a CPU, torch on a
    GPU); fails at the first wrong byte, naming the pattern and offset. Reports write+read GB/s."""
    device = torch.device(device)
    t0 = time.perf_counter()
    buf = _NumpyWords(mbytes << 20) if device.type == "cpu" else _TorchWords(mbytes << 20, device)
    buf.write(0)  # first touch (page faults) outside the timing
    _sync(device)
    t1, detail, ok = time.perf_counter(), f"{mbytes} MiB ok", True
    for pattern in (*_PATTERNS, _ADDRESS):
        buf.write(pattern)
        bad = buf.first_bad(pattern)
        if bad is not None:
            ok, detail = False, f"pattern {_pattern_name(pattern)} wrong at {_byte_diff(*bad)}"
            break
    _sync(device)
    rate = _gbs(2 * (len(_PATTERNS) + 1) * (mbytes << 20), time.perf_counter() - t1)
    if ok:
        detail = f"{mbytes} MiB ok ({_fmt_rate(rate)})"
    return _injected(CheckResult("memory", ok, time.perf_counter() - t0, detail, rate))


# --------------------------------------------------------------------------- collectives


def _device_of(group) -> torch.device:
    """The device a group's tensors live on: a CUDA one for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _guard(name: str, fn, *args, **kwargs) -> CheckResult:
    """fn's result, or a failure naming the exception (a dead peer, a timeout): a check that raises
    is a failed check, and the report must still be made."""
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every error is a finding here
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return _injected(CheckResult(name, False, time.perf_counter() - t0, f"{type(e).__name__}: {first}"))


def check_host_allreduce(group, ranks: list[int], mbytes: int = 4) -> CheckResult:
    """All-reduce among this host's ranks (`group`, whose members are `ranks`): each rank gives
    (rank + 1) * (i % 7 + 1) at index i, so the sum is known exactly; timed after a warm-up."""
    t0, device = time.perf_counter(), _device_of(group)
    size, group_ranks = dist.get_world_size(group), _members(group)
    if sorted(ranks) != group_ranks:
        raise ValueError(f"ranks {ranks} are not the group's {group_ranks}")
    n = (mbytes << 20) // 4
    shape = (torch.arange(n, device=device) % 7 + 1).float()
    x = shape * (dist.get_rank() + 1)
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # warm-up: connections, communicator
    _sync(device)
    t1 = time.perf_counter()
    dist.all_reduce(x, group=group)
    _sync(device)
    seconds = time.perf_counter() - t1
    bus = _gbs(2 * (size - 1) / size * x.numel() * 4, seconds)  # nccl-tests' bus bandwidth
    wrong = int((x != shape * sum(r + 1 for r in ranks)).sum())
    members = f"{size} rank{'s' * (size != 1)}"
    detail = f"ok ({members}, {_fmt_rate(bus)} bus)"
    if wrong:
        detail = f"sum wrong in {wrong} of {n} elements ({members})"
    return _injected(CheckResult("allreduce", not wrong, time.perf_counter() - t0, detail, bus))


def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _p2p_payload(src: int, n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32, device=device) * 7 + src


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer_send: int, peer_recv: int, group) -> None:
    # Both posted at once (batch_isend_irecv): with NCCL a blocking recv after an isend on a two-rank
    # ring shares the pair's stream with the peer's send and can deadlock; gloo issues them as is.
    ops = [dist.P2POp(dist.isend, send, peer_send, group), dist.P2POp(dist.irecv, recv, peer_recv, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def check_p2p(peer_send: int, peer_recv: int, group=None, mbytes: int = 8) -> CheckResult:
    """Send a known payload to `peer_send` and receive one from `peer_recv` (global ranks), a ring in
    which every rank of `group` takes part; the received payload is checked, the send rate timed."""
    t0, device, me = time.perf_counter(), _device_of(group), dist.get_rank()
    n = (mbytes << 20) // 4
    one = torch.zeros(1, dtype=torch.int32, device=device)
    _exchange(one, one.clone(), peer_send, peer_recv, group)  # warm-up: NCCL builds the pair's comm lazily
    send, recv = _p2p_payload(me, n, device), torch.empty(n, dtype=torch.int32, device=device)
    _sync(device)
    t1 = time.perf_counter()
    _exchange(send, recv, peer_send, peer_recv, group)
    _sync(device)
    rate = _gbs(n * 4, time.perf_counter() - t1)
    bad = (recv != _p2p_payload(peer_recv, n, device)).nonzero()
    detail = f"{_fmt_rate(rate)} to rank {peer_send}"
    if bad.numel():
        detail = f"payload from rank {peer_recv} corrupted: {bad.numel()} of {n} words differ " \
                 f"(first at {int(bad[0, 0])})"
    return _injected(CheckResult("p2p", not bad.numel(), time.perf_counter() - t0, detail, rate))


def check_host_alltoall(group, mbytes: int = 4) -> CheckResult:
    """All-to-all among this host's ranks (NCCL within a GPU host): the block rank i sends rank j
    holds (i * size + j) * m + arange(m), so every received block is checked for sender and order."""
    t0, device = time.perf_counter(), _device_of(group)
    size = dist.get_world_size(group)
    me = dist.get_group_rank(group if group is not None else dist.group.WORLD, dist.get_rank())
    m = max(1, (mbytes << 20) // 8 // size)
    idx = torch.arange(m, dtype=torch.int64, device=device)
    send = torch.cat([(me * size + j) * m + idx for j in range(size)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(torch.zeros(size, device=device), torch.zeros(size, device=device), group=group)
    _sync(device)
    t1 = time.perf_counter()
    dist.all_to_all_single(recv, send, group=group)
    _sync(device)
    rate = _gbs(send.numel() * 8 * (size - 1) / size, time.perf_counter() - t1)
    want = torch.cat([(i * size + me) * m + idx for i in range(size)])
    wrong = [i for i in range(size) if not torch.equal(recv[i * m:(i + 1) * m], want[i * m:(i + 1) * m])]
    detail = f"ok ({size} ranks, {_fmt_rate(rate)})" if not wrong else f"blocks from ranks {wrong} wrong"
    return _injected(CheckResult("alltoall", not wrong, time.perf_counter() - t0, detail, rate))


# --------------------------------------------------------------------------- all checks


@dataclass(frozen=True)
class Sizes:
    """How big each check is: quick (before every start, well under a second) or full (on demand)."""

    matmul_n: int
    matmul_runs: int
    memory_mb: int
    allreduce_mb: int
    p2p_mb: int


QUICK = {"cpu": Sizes(512, 3, 64, 1, 1), "cuda": Sizes(4096, 5, 1024, 64, 64)}
FULL = {"cpu": Sizes(2048, 5, 256, 16, 16), "cuda": Sizes(8192, 10, 8192, 512, 512)}


def _neighbours(ring_group) -> tuple[int, int] | None:
    """(next, previous) global rank in the ring group's rank order, or None for a ring of one."""
    ranks = dist.get_process_group_ranks(ring_group)
    if len(ranks) < 2:
        return None
    i = ranks.index(dist.get_rank())
    return ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]


def run_selfcheck(device="cpu", host_group=None, host_ranks: list[int] | None = None, ring_group=None,
                  quick: bool = True, alltoall: bool | None = None,
                  min_fraction: float = 0.5, memory_share: int = 1) -> SelfCheckReport:
    """All checks of this rank: matmul and memory always; the host all-reduce (and on GPUs the host
    all-to-all) when `host_group` is given, p2p with the ring neighbours when `ring_group` is. The
    collective ones must be called on every rank of their groups, in this order.

    `min_fraction` is the matmul speed floor (x the best rate recorded). The record is the fastest
    this key ever ran, so on a machine shared with other work (CI, a laptop) a quick check can fall
    well below it: pass 0 there to check correctness only.

    `memory_share`: on a CPU, this many ranks share the host's memory and each tests 1/share of the
    pattern buffer (a GPU's memory is its own: each tests the whole size). Together they still cover
    the host's full size, at the cost of one rank's test instead of `share` of them at once.
    """
    device = torch.device(device)
    sizes = (QUICK if quick else FULL)["cuda" if device.type == "cuda" else "cpu"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what training runs in
    results = [
        _guard("matmul", check_matmul, device, dtype, sizes.matmul_n, min_fraction, sizes.matmul_runs),
        _guard("memory", check_memory, _memory_mb(sizes.memory_mb, device, memory_share), device),
    ]
    if host_group is not None:
        ranks = host_ranks if host_ranks is not None else dist.get_process_group_ranks(host_group)
        results.append(_guard("allreduce", check_host_allreduce, host_group, ranks, sizes.allreduce_mb))
        if alltoall if alltoall is not None else device.type == "cuda":
            results.append(_guard("alltoall", check_host_alltoall, host_group, sizes.allreduce_mb))
    peers = _neighbours(ring_group) if ring_group is not None else None
    if peers is not None:
        results.append(_guard("p2p", check_p2p, *peers, ring_group, sizes.p2p_mb))
    return SelfCheckReport(inject.host_id(), _rank(), results)


def _memory_mb(mbytes: int, device: torch.device, share: int) -> int:
    """This rank's part of the host's memory test (see run_selfcheck's memory_share)."""
    return mbytes if device.type == "cuda" else max(1, mbytes // max(1, share))


# --------------------------------------------------------------------------- megascale diagnose --hosts


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megascale diagnose --hosts",
        description="self-check this host (under torchrun: every rank, with the collective checks)")
    p.add_argument("--hosts", action="store_true", help=argparse.SUPPRESS)  # the verb's flag, if passed on
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--full", action="store_true",
                   help="bigger checks (the default is the quick pre-start set)")
    p.add_argument("--min-fraction", type=float, default=0.5,
                   help="fail a matmul slower than this x the best rate recorded here (0: no speed check)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    p.add_argument("--json", action="store_true", help="one JSON report per rank instead of lines")
    return p


def _host_groups(world: int, local: int):
    """(this rank's host group, its ranks, its ring group). Hosts are rank // LOCAL_WORLD_SIZE, as
    torchrun numbers them; the ring joins the same local rank on every host (the inter-host links), or
    on a single host all its ranks. Every rank creates every group, in the same order."""
    if world % local:
        raise ValueError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local}")
    rank, hosts = dist.get_rank(), world // local
    host_group = ranks = None
    for h in range(hosts):
        members = list(range(h * local, (h + 1) * local))
        g = dist.new_group(members)
        if rank in members:
            host_group, ranks = g, members
    if hosts == 1:
        return host_group, ranks, dist.group.WORLD
    ring = None
    for lr in range(local):
        g = dist.new_group([lr + h * local for h in range(hosts)])
        if rank % local == lr:
            ring = g
    return host_group, ranks, ring


def _init(device: torch.device, timeout_s: float) -> bool:
    """Join the launcher's world (env://) if there is one; whether we did."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # reports travel over gloo
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def _print(reports: list[SelfCheckReport], as_json: bool) -> None:
    for r in sorted(reports, key=lambda r: r.rank):
        print(json.dumps(r.to_dict()) if as_json else r.line())
    sys.stdout.flush()


def hosts_main(argv: list[str] | None = None) -> int:
    """`megascale diagnose --hosts`: run the self-check, print each rank's line (rank 0 prints all of
    them under torchrun), exit 0 if every check of every rank passed, else 1."""
    args = _parser().parse_args(argv)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    joined = _init(device, args.timeout_s)
    try:
        if not dist.is_initialized():
            report = run_selfcheck(device, quick=not args.full, min_fraction=args.min_fraction)
            _print([report], args.json)
            return 0 if report.ok else 1
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        host_group, ranks, ring = _host_groups(world, local)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        report = run_selfcheck(device, host_group, ranks, ring, quick=not args.full,
                               min_fraction=args.min_fraction)
        reports: list = [None] * world
        dist.all_gather_object(reports, report)
        if dist.get_rank() == 0:
            _print(reports, args.json)
        return 0 if all(r.ok for r in reports) else 1
    finally:
        if joined:
            dist.destroy_process_group()


def cpu_share() -> float:
    """The fraction of the cores one rank can have: the host's ranks (LOCAL_WORLD_SIZE) times each one's
    threads over the cores. A recorded best is one process's with its threads to itself; N ranks on a
    host of fewer cores each get a part, and a check that ignored it would fail every healthy host."""
    want = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * torch.get_num_threads()
    return min(1.0, (os.cpu_count() or 1) / max(1, want))


def under_launcher() -> bool:
    """Whether `megascale launch` started this process (the self-check is its business; a plain torchrun
    or `megascale train --nproc` job does not run it)."""
    env = os.environ
    # MEGASCALE_LAUNCH alone could be inherited by a job started from inside a launched one; elastic's
    # agent also sets the restart count for its workers (not TORCHELASTIC_USE_AGENT_STORE: with the
    # per-round stores of a multi-host job that is False)
    return env.get("MEGASCALE_LAUNCH") == "1" and "TORCHELASTIC_RESTART_COUNT" in env


def host_selfcheck(device, min_fraction: float, warn) -> SelfCheckReport:
    """The Trainer's check before each (re)start of a launched job (collective over the world): every
    rank checks itself, its host's ranks all-reduce among themselves, the world passes a p2p ring.
    A failure on any rank raises on every rank, naming the hosts and checks: HostCheckError on the
    ranks of a host that failed (exit 4: the driver evicts it), PeerHostEvicted on the others (exit 5:
    the driver restarts them without it)."""
    from megascale.errors import HostCheckError, PeerHostEvicted

    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    host_group, host_ranks = None, None
    if local > 1 and world % local == 0:
        for h in range(world // local):  # every rank makes every host's group, in order
            ranks = list(range(h * local, (h + 1) * local))
            g = dist.new_group(ranks)
            if rank in ranks:
                host_group, host_ranks = g, ranks
    report = run_selfcheck(device, host_group=host_group, host_ranks=host_ranks, ring_group=dist.group.WORLD,
                           min_fraction=min_fraction, memory_share=local if world % local == 0 else 1)
    every: list = [None] * world
    dist.all_gather_object(every, (report.ok, report.line(), report.host))
    failed = [line for ok, line, _ in every if not ok]
    if failed:
        more = f" (and {len(failed) - 8} more)" if len(failed) > 8 else ""
        why = "; ".join(failed[:8]) + more
        bad = sorted({host for ok, _, host in every if not ok})
        if report.host in bad:  # every rank of a failed host leaves: the driver evicts the host
            raise HostCheckError(why)
        raise PeerHostEvicted(f"host {', '.join(bad)} failed the self-check and is evicted ({why}); "
                              f"this host ({report.host}) passed and restarts without it")
    if rank == 0:
        warn(f"self-check passed on {world} ranks ({report.line().split(': ', 1)[-1]} on rank 0)")
    return report
