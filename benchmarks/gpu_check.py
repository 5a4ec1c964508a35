"""The project's GPU check: what only a GPU can show, in one short run (a few minutes on one device).

    python benchmarks/gpu_check.py [--steps 30] [--block 5]

Run it whenever a session is lent a GPU, and put its figures in the closing note. It prints:

* the device, its peak from the table (SXM vs PCIe/NVL told apart) and the peak's source;
* tokens/s and MFU (exact and published convention) of the bench config in bf16, one process;
* the always-on timers on a GPU: compute spans are CUDA event pairs read lazily, so the step
  must not synchronise for them; the overhead, timers on vs off in alternating blocks of steps;
  and that the trace holds forward/backward spans with device durations.

On a machine without CUDA it says so and exits 0: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps for the throughput figure")
    ap.add_argument("--block", type=int, default=5, help="steps per timers on/off block")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench_gpt_19m.toml"))
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: nothing to check")
        return
    from megascale.config import load_config
    from megascale.observe import timers
    from megascale.observe.trace import read_run
    from megascale.perf.hardware import peak_info
    from megascale.train import Trainer

    name = torch.cuda.get_device_name()
    info = peak_info(name, "bf16")
    print(f"device: {name}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"peak: {info.flops / 1e12:.0f} TFLOP/s bf16 ({info.source}: {info.detail})")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(a.config, [
            "train.device=cuda", "train.dtype=bf16", f"train.steps={a.steps + 2 * a.rounds * a.block + 4}",
            "train.eval_interval=0", "log.progress=false", "log.tensorboard=false", "log.sample_tokens=0",
            "checkpoint.interval=0", f"train.run_dir={json.dumps(tmp + '/run')}",
            f"data.path={json.dumps(tmp + '/ds')}",
            f"data.source={json.dumps(str(ROOT / 'data' / 'shakespeare'))}"])
        t = Trainer(cfg, quiet=True)
        rec = t.observer.recorder
        for _ in range(3):
            t.train_step()
        stats = [t.train_step() for _ in range(a.steps)]
        med = statistics.median(s.step_time for s in stats)
        mfu = statistics.median(s.mfu for s in stats)
        published = statistics.median(s.mfu_published for s in stats)
        print(f"throughput: {t.tokens_per_step / med:,.0f} tokens/s, MFU {100 * mfu:.1f}% exact, "
              f"{100 * published:.1f}% published convention (median step {1e3 * med:.1f} ms)")
        ratios = []
        for r in range(a.rounds):
            got = {}
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                timers.install(rec if on else None)
                got[on] = statistics.median(t.train_step().step_time for _ in range(a.block))
            ratios.append(got[True] / got[False])
        timers.install(rec)
        t.close()
        print("timers on/off per round: " + ", ".join(f"{q:.4f}" for q in ratios)
              + f"; median {statistics.median(ratios):.4f}")
        events = read_run(tmp + "/run")[0].events
        fwd = [e.dur for e in events if e.op == "forward"]
        bwd = [e.dur for e in events if e.op == "backward"]
        print(f"trace: {len(events)} spans; forward {len(fwd)} (median {statistics.median(fwd) / 1e6:.2f} ms "
              f"on the device), backward {len(bwd)} (median {statistics.median(bwd) / 1e6:.2f} ms)")


if __name__ == "__main__":
    main()
