"""Smoke test of benchmarks/parity_soak.py: random feature combinations, each layout against one process."""

import random
import re
from pathlib import Path

from _bench import load_benchmark, run_benchmark

from megascale.config import load_config, validate_layout

ROOT = Path(__file__).resolve().parents[1]


def test_one_combination_trains_as_one_process_and_as_its_layout():
    out = run_benchmark("benchmarks/parity_soak.py", "--combos", "1", "--world", "2", "--steps", "2")
    assert re.search(r"^\[0\] world 2, \d+ s, equal: loss rel [\d.e+-]+ \(tolerance", out, re.M), out
    assert out.rstrip().endswith("parity soak: 1 equal, 0 differ, 0 failed, 0 refused"), out


def test_every_drawn_combination_is_a_config_the_trainer_accepts():
    """The soak's time goes to training, not to layouts the config check refuses."""
    soak = load_benchmark("parity_soak.py", "parity_soak")
    rng = random.Random(0)
    for _ in range(300):
        world = rng.choice(sorted(soak.LAYOUTS))
        _, model, layout = soak.draw(rng, world)
        cfg = load_config(ROOT / "configs" / "cpu_default.toml", [*soak.SMALL, *model, *layout])
        validate_layout(cfg)
        assert cfg.parallel.world_size == world
