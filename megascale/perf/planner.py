"""Search the layouts of a job: every (tp, pp, vpp, dp, micro-batch) that can run the model.

The space is small enough to enumerate outright: tp divides the node and the head count,
pp divides the layers, vpp divides the layers per stage, and the micro-batch splits the
batch. Each candidate is predicted without recomputation first; only if that does not fit
in memory is the recomputing variant tried. Candidates are ranked by step time, those that
fit first; the rows shown get a full time breakdown (two more timeline simulations each).
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config import ModelConfig
from megascale.errors import UserError
from megascale.perf.presets import ClusterPreset
from megascale.perf.step import Layout, Prediction, Settings, predict

MICRO_BATCHES = (1, 2, 4, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: ModelConfig, preset: ClusterPreset, gpus: int, batch: int) -> list[Layout]:
    out = []
    for tp in _divisors(preset.devices_per_node):
        if cfg.n_heads % tp or gpus % tp:
            continue
        for pp in _divisors(cfg.n_layers):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for vpp in _divisors(cfg.n_layers // pp):
                if pp == 1 and vpp > 1:
                    continue
                for mb in MICRO_BATCHES:
                    if batch % (dp * mb):
                        continue
                    m = batch // (dp * mb)
                    if vpp > 1 and m % pp:
                        continue
                    out.append(Layout(tp, pp, dp, vpp, mb))
    return out


@dataclass
class SearchResult:
    ranked: list[Prediction]  # all candidates, best first (fitting ones before the rest)
    evaluated: int


def search(
    cfg: ModelConfig,
    preset: ClusterPreset,
    gpus: int,
    batch: int,
    settings: Settings,
    top: int = 10,
    policy: str | None = None,
) -> SearchResult:
    layouts = candidates(cfg, preset, gpus, batch)
    if not layouts:
        raise UserError(
            f"no layout of {gpus} devices runs this model with batch {batch} "
            f"(n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, {preset.devices_per_node} per node)"
        )
    preds: list[Prediction] = []
    for lay in layouts:
        pred = predict(cfg, lay, preset, settings, batch, policy)
        if not pred.fits:
            rc = Layout(lay.tp, lay.pp, lay.dp, lay.vpp, lay.micro_batch, recompute=True)
            pred_rc = predict(cfg, rc, preset, settings, batch, policy)
            if pred_rc.fits:
                pred = pred_rc
        preds.append(pred)
    preds.sort(key=lambda p: (not p.fits, p.step_time))
    for i, p in enumerate(preds[:top]):
        preds[i] = predict(cfg, p.layout, preset, settings, batch, policy, explain=True)
    return SearchResult(preds, len(layouts))
