"""LAMB (You et al. 2019, arXiv 1904.00962): Adam with a layer-wise trust ratio.

MegaScale trains with LAMB because it keeps the loss of a 4x larger batch on par with
AdamW, which cuts data-parallel communication per token by 4x. Per tensor p with
gradient g, at step t (all ops per element, norms over the whole tensor):

    m <- beta1 m + (1 - beta1) g            v <- beta2 v + (1 - beta2) g^2
    u  = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * p
    r  = ||p|| / ||u||   (r = 1 when either norm is zero, or when the group has adapt=False)
    p <- p - lr * r * u

Why the squared norms go through `norm_reducer`: under ZeRO-2 and tensor parallelism a
rank holds only a piece of each tensor, but r needs the norms of the *whole* tensor.
Squared norms add over disjoint pieces, so each rank computes the squared norms of its
pieces, stacks them as a (2, n) tensor (row 0: ||p||^2, row 1: ||u||^2, one column per
tensor with a gradient, in param-group order), and a distributed optimizer installs a
reducer that all-reduces (sums) that one small tensor over the group which holds the
pieces. One collective per step for all groups, not one per tensor. A tensor replicated
on k ranks of that group comes back with both rows scaled by k, which leaves r unchanged.
All ranks must present the same columns in the same order (same tensors, grads present).

Default for `adapt`: the optimizer applies the trust ratio to every group unless told
otherwise (the paper's algorithm), and `build_optimizer` turns it off for the no-decay
group (biases, norm gains). That matches NVIDIA apex FusedLAMB (used by Megatron-LM and
the NVIDIA BERT recipes), whose kernel applies the ratio only where weight_decay != 0
unless `use_nvlamb=True`, and timm's `Lamb(always_adapt=False)`. The reason: a bias
starts at zero, so its ||p|| is tiny early on and r would all but freeze it; norm gains
are a handful of scalars near 1 for which a per-layer step size buys nothing.

State per parameter is exactly torch's Adam layout (`step` as a float32 CPU tensor,
`exp_avg`, `exp_avg_sq`), so `state_dict`/`load_state_dict` and a resume are bit-exact
and checkpoint tools that know AdamW's state know ours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

NormReducer = Callable[[Tensor], Tensor]


class Lamb(Optimizer):
    """LAMB over torch._foreach_* kernels: one pass of multi-tensor ops per group.

    Group options: lr, betas, eps, weight_decay (added to the Adam direction, as in the
    paper, so it is scaled by the trust ratio too) and adapt (apply the trust ratio).
    `norm_reducer`, if set, maps the stacked local squared norms (2, n) to global ones.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        adapt: bool = True,
        norm_reducer: NormReducer | None = None,
    ):
        if lr < 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Lamb: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=adapt)
        super().__init__(params, defaults)
        self.norm_reducer = norm_reducer

    def _gather(self, group: dict[str, Any]) -> tuple[list[Tensor], ...]:
        """The group's tensors that have a gradient, and their state (created on first use)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lamb does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return params, grads, exp_avgs, exp_avg_sqs, steps

    @staticmethod
    def _direction(group, params, grads, exp_avgs, exp_avg_sqs, steps) -> list[Tensor]:
        """Update the moments in place and return u = m_hat / (sqrt(v_hat) + eps) + wd * p."""
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)
        counts = [s.item() for s in steps]  # CPU scalars: no device sync
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        # u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps), with bc1 moved into the denominator so
        # that u is built in place in one new buffer (AdamW's foreach path allocates one too;
        # on CPU a second param-sized allocation costs more than the arithmetic).
        update = torch._foreach_sqrt(exp_avg_sqs)
        bc1 = [1.0 - beta1**t for t in counts]
        torch._foreach_mul_(update, [c / (1.0 - beta2**t) ** 0.5 for c, t in zip(bc1, counts, strict=True)])
        torch._foreach_add_(update, [c * group["eps"] for c in bc1])
        torch._foreach_reciprocal_(update)
        torch._foreach_mul_(update, exp_avgs)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        return update

    def squared_norms(self, params: list[Tensor], updates: list[Tensor]) -> Tensor:
        """Local (2, n) squared norms of params (row 0) and updates (row 1), then the reducer."""
        norms = torch._foreach_norm(params) + torch._foreach_norm(updates)
        sq = torch.stack(norms).square().view(2, len(params))
        return sq if self.norm_reducer is None else self.norm_reducer(sq)

    @staticmethod
    def trust_ratios(sq: Tensor) -> Tensor:
        """r = ||p|| / ||u|| per column of the (global) squared norms; 1 where either is 0."""
        p_norm, u_norm = sq[0].sqrt(), sq[1].sqrt()
        ok = (p_norm > 0) & (u_norm > 0)
        return torch.where(ok, p_norm / torch.where(ok, u_norm, 1.0), 1.0)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        adapt_params: list[Tensor] = []
        adapt_updates: list[Tensor] = []
        adapt_lrs: list[float] = []
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = self._gather(group)
            if not params:
                continue
            update = self._direction(group, params, grads, exp_avgs, exp_avg_sqs, steps)
            if group["adapt"]:
                adapt_params += params
                adapt_updates += update
                adapt_lrs += [group["lr"]] * len(params)
            else:
                torch._foreach_add_(params, update, alpha=-group["lr"])

        if adapt_params:
            # One stacked tensor for every adapted group: one reduction (collective) per step.
            ratios = self.trust_ratios(self.squared_norms(adapt_params, adapt_updates))
            lrs = torch.tensor(adapt_lrs, dtype=ratios.dtype, device=ratios.device)
            # p <- p + u * (-lr r): one pass, the per-tensor factor as a 0-d tensor (no host sync).
            torch._foreach_addcmul_(adapt_params, adapt_updates, list((-lrs * ratios).unbind()))
        return loss
