"""``DirectAdamW``: the trainer's AdamW, torch's own update without ``torch.optim.Optimizer``.

Every ``torch.optim.Optimizer`` wraps its construction, ``zero_grad`` and ``step`` in guards
that import ``torch._dynamo`` on first use: about 1 s of CPU, as much as importing torch
itself, paid on the critical path of every run's first step (a third of it, on a small
model). This calls the very function ``torch.optim.AdamW`` calls (``torch.optim.adam.adam``
with decoupled weight decay: the same arithmetic, bit for bit) on state it keeps itself, and
reads and writes ``torch.optim.AdamW``'s ``state_dict`` format, so checkpoints of either load
into the other. The ranked trainer (FSDP2 and DCP's optimizer state) keeps ``torch.optim``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

__all__ = ["DirectAdamW"]


class DirectAdamW:
    """AdamW over ``params`` (one parameter group), ``torch.optim.AdamW``'s defaults
    otherwise; parameters without a gradient are skipped (frozen ones, as torch does)."""

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.params = list(params)
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = betas
        self.eps = eps
        self.state: dict[int, dict[str, Tensor]] = {}  # by the parameter's index

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every parameter that has a gradient."""
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            state = self.state.get(index)
            if state is None:
                state = self.state[index] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=None, capturable=False, differentiable=False, fused=None,
            grad_scale=None, found_inf=None,
            has_complex=any(torch.is_complex(p) for p in params),
            decoupled_weight_decay=True, amsgrad=False,
            beta1=self.betas[0], beta2=self.betas[1], lr=self.lr,
            weight_decay=self.weight_decay, eps=self.eps, maximize=False,
        )  # fmt: skip

    def _group(self) -> dict[str, Any]:
        """The one parameter group as ``torch.optim.AdamW`` writes it."""
        return {
            "lr": self.lr, "betas": self.betas, "eps": self.eps,
            "weight_decay": self.weight_decay, "amsgrad": False, "foreach": None,
            "maximize": False, "capturable": False, "differentiable": False, "fused": None,
            "decoupled_weight_decay": True, "params": list(range(len(self.params))),
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW.state_dict()``'s layout: state by parameter index, one group."""
        return {
            "state": {index: dict(state) for index, state in sorted(self.state.items())},
            "param_groups": [self._group()],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take a ``state_dict`` of this class or of ``torch.optim.AdamW`` over the same
        parameters (moments cast to each parameter's dtype and device, as torch does)."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            sizes = [len(g["params"]) for g in groups]
            raise ValueError(
                f"optimizer state of groups {sizes} does not fit one group of "
                f"{len(self.params)} parameters"
            )
        group = groups[0]
        self.lr = float(group["lr"])
        self.weight_decay = float(group["weight_decay"])
        self.betas = (float(group["betas"][0]), float(group["betas"][1]))
        self.eps = float(group["eps"])
        position = {int(pid): i for i, pid in enumerate(group["params"])}
        self.state = {}
        for pid, entry in state_dict["state"].items():
            index = position[int(pid)]
            param = self.params[index]
            state: dict[str, Tensor] = {}
            for key, value in entry.items():
                tensor = value if isinstance(value, Tensor) else torch.tensor(float(value))
                if key == "step":
                    state[key] = tensor.detach().to(dtype=torch.float32, device="cpu").clone()
                else:
                    state[key] = tensor.detach().to(dtype=param.dtype, device=param.device)
            self.state[index] = state
