"""Smoke test of benchmarks/lamb_vs_adamw.py: both optimizers trained on the same tokens, and step times."""

import re

from _bench import run_benchmark


def run(*args: str) -> str:
    return run_benchmark("benchmarks/lamb_vs_adamw.py", *args)


def test_lamb_at_4x_batch_and_adamw_train_on_the_same_tokens():
    out = run("--steps", "8", "--batch", "2", "--micro-batch", "2", "--seq-len", "32", "--layers", "1",
              "--d-model", "32", "--heads", "2", "--adamw-lrs", "1e-3", "--lamb-lrs", "1e-2",
              "--eval-batches", "2")
    best = re.findall(r"^ +(adamw|lamb) batch +(\d+) x +(\d+) steps, lr [\d.e+-]+: val (\d+\.\d+)$",
                      out, re.M)
    assert [(o, int(b) * int(s)) for o, b, s, _ in best] == [("adamw", 16), ("lamb", 16)], out
    assert re.search(r"LAMB at 4x batch - AdamW = [+-]\d+\.\d+ nats", out), out


def test_the_optimizer_step_time_of_both():
    out = run("--step-time", "--layers", "1", "--d-model", "64")
    assert re.search(r"AdamW\(foreach=True\) +\d+\.\d ms", out), out
    assert re.search(r"LAMB \(ours\) .*\(\d+\.\d\dx\)", out), out
