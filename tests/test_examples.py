"""The cluster examples in examples/ are real commands: their `megascale launch` lines parse with the
CLI, their configs load and fit the world the example asks for, and the files are valid Bash/YAML."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import yaml

from megascale.cli import build_parser
from megascale.config import check_world_size, load_config

ROOT = Path(__file__).resolve().parents[1]


def _check_launch(argv: list[str]) -> None:
    assert argv[0] == "launch", argv
    args, extra = build_parser().parse_known_args(argv)
    overrides = [*args.overrides, *extra]
    cfg = load_config(ROOT / args.config, overrides)
    nnodes = int(args.nnodes)
    check_world_size(cfg, nnodes * args.nproc_per_node, "the example's nodes x processes per node")
    assert args.rdzv_endpoint.endswith(":29400") and args.rdzv_id


def test_slurm_example():
    path = ROOT / "examples" / "slurm" / "megascale.sbatch"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("srun ") and "megascale launch" in x)
    nodes = re.search(r"#SBATCH --nodes=(\d+)", path.read_text()).group(1)
    env = {"SLURM_NNODES": nodes, "head": "node001", "SLURM_JOB_ID": "42", "run_dir": "/shared/runs/x"}
    expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), line)
    words = shlex.split(expanded)
    _check_launch(words[words.index("megascale") + 1:])


def test_kubernetes_example():
    docs = list(yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "megascale.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[0] == "megascale"
    expanded = []
    for w in command[1:]:  # --flag=value as the CLI takes it either way
        expanded += w.split("=", 1) if w.startswith("--") else [w]
    _check_launch(expanded)
    nnodes = int(next(w for w in command if w.startswith("--nnodes")).split("=")[1])
    assert job["spec"]["completions"] == nnodes  # one pod per host
    assert os.path.basename(container["volumeMounts"][1]["mountPath"]) == "shm"
