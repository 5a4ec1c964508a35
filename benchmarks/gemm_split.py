"""What the tensor-parallel overlap's GEMM pieces cost on this CPU (parallel/tensor/overlap.py).

To run a sequence-parallel GEMM while the next rank's rows are still on the wire, the tp overlap
computes it in pieces: one per rank's rows and, since a rank's rows of a full-sequence tensor are one
block per sequence, one per sequence of the micro-batch (parallel/tensor/slots.py `gemm_into`). With
one chunk a layer's GEMM becomes tp x micro_batch GEMMs of fewer rows. On this CPU each GEMM call
packs its operands into MKL's blocked layout, the weight among them, so k pieces pack the weight k
times: nearly free while it fits in a core's L2 cache, not once it does not.

For each d_model, the GPT block's four forward GEMMs at `--tp` ranks (qkv d -> 3d / tp, the
attention's out projection d / tp -> d, fc_in d -> 4d / tp, fc_out 4d / tp -> d) on the micro-batch's
rows (micro_batch x seq): one GEMM of all of them against the same rows in tp x micro_batch pieces,
each written in place as `gemm_into` does; medians over `--repeats`, the two taking turns; each
weight's size against this core's L2 (sysfs). One thread (`--threads`), as a rank pinned to its core
on the simulated cluster runs. Measured on a 2-core VM (Xeon, AVX-512, 2 MiB of L2 a core), tp 2,
micro-batch 2 x 128 (4 pieces), two runs: weights up to L2's size (d_model 256 and 512, 0.1-2 MiB)
x0.93-1.06 of one GEMM; 3x L2 (d_model 1024's qkv, 6 MiB) x1.07-1.09; 4x L2 and more (its fc_in
and fc_out, 8 MiB, and every GEMM at 2048) x1.28-1.38. Hence `benchmarks/overlap.py --dims tp
--d-model 1024` puts the overlap's own code at x1.12 (its no-comm variant's compute against the
serial one's) where it is x1.00-1.05 at 256: on a CPU the overlap pays more per GEMM as the model
widens, against the more wire time its wider GEMMs could hide. torch's packed-weight MKL path
(`torch.ops.mkl._mkl_linear`: pack once, then the pieces) did not win it back: the packing alone
took 1.2 ms at 1024 x 3072 and 9.5 ms at 2048 x 3072 (two pieces of 128 rows: 11.0 against 11.3 ms
unpacked, and 31.0 against 23.8).

    .venv/bin/python benchmarks/gemm_split.py [--d-model 256 512 1024 2048] [--tp 2] [--micro 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def l2_bytes() -> int | None:
    """This core's L2 cache (sysfs), or None where the machine does not say."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip()  # "2048K"
                unit = {"K": 1024, "M": 1024 ** 2}.get(size[-1], 1)
                return int(size[:-1] if unit > 1 else size) * unit
        except (OSError, ValueError):
            continue
    return None


def shapes(d: int, tp: int) -> list[tuple[str, int, int]]:
    """(name, in, out) of the block's forward GEMMs on one of tp ranks."""
    return [("qkv", d, 3 * d // tp), ("proj", d // tp, d),
            ("fc_in", d, 4 * d // tp), ("fc_out", 4 * d // tp, d)]


def measure(d_in: int, d_out: int, rows: int, pieces: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one (rows x d_in) @ (d_in x d_out) GEMM and of the same rows in `pieces`
    GEMMs, each written into its rows of the output, the two alternating."""
    import torch

    x, w = torch.randn(rows, d_in), torch.randn(d_in, d_out)
    out = torch.empty(rows, d_out)
    step = rows // pieces
    parts = [(x[i * step:(i + 1) * step], out[i * step:(i + 1) * step]) for i in range(pieces)]

    def whole() -> None:
        torch.mm(x, w, out=out)

    def split() -> None:
        for a, o in parts:
            torch.mm(a, w, out=o)

    times: dict = {whole: [], split: []}
    for fn in (whole, split):  # warm: MKL's buffers, the pages
        fn()
    for i in range(repeats):
        for fn in ((whole, split) if i % 2 == 0 else (split, whole)):
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    return statistics.median(times[whole]), statistics.median(times[split])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    l2 = l2_bytes()
    rows, pieces = a.micro * a.seq, a.tp * a.micro
    print(f"{rows} rows (micro-batch {a.micro} x seq {a.seq}) in {pieces} pieces (tp {a.tp} x {a.micro} "
          f"sequences), {a.threads} thread(s); L2 {f'{l2 / 2**20:g} MiB' if l2 else 'unknown'} a core")
    for d in a.d_model:
        for name, d_in, d_out in shapes(d, a.tp):
            one, split = measure(d_in, d_out, rows, pieces, a.repeats)
            size = d_in * d_out * 4
            beside = f", {size / l2:.1f}x L2" if l2 else ""
            print(f"d_model {d:5d}  {name:6s} {d_in:5d} x {d_out:5d} ({size / 2**20:5.2f} MiB{beside})  "
                  f"one GEMM {one * 1e3:8.3f} ms  pieces x{split / one:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
