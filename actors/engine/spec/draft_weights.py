"""DraftWeights: the draft model's part of a weight update, in the target's transaction.

A trainer that trains the draft too sends its tensors in the same update as the target's,
named `draft.<the draft's HF name>` (e.g. `draft.model.layers.0.mlp.up_proj.weight`).
`WeightSync` splits them off: `check` runs with the target ranks' manifest check (begin), so
a bad draft tensor fails the update before anything changes; `load` saves what it is about
to overwrite (once per transaction) and copies in place; `rollback` (abort) puts it back;
`finish` keeps it when the target's version switches. So after any update the draft's
weights and the target's are of one version, and there is no draft version of its own.

The draft model runs in the engine process (draft_model.py), so its tensors arrive in
buckets; a trainer's collective broadcast reaches the target's ranks only.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.weights import TensorSpec

DRAFT_PREFIX = "draft."


def is_draft(name: str) -> bool:
    return name.startswith(DRAFT_PREFIX)


class DraftWeights:
    def __init__(self, model: torch.nn.Module | None = None) -> None:
        # every name of a parameter (tied ones under each of their names)
        self._params: dict[str, torch.nn.Parameter] = (
            dict(model.named_parameters(remove_duplicate=False)) if model is not None else {}
        )
        self._saved: dict[str, torch.Tensor] | None = None  # old values, this transaction

    def check(self, specs: list[TensorSpec], begin: bool = True) -> None:
        """ValueError naming the first draft tensor that would not load (no draft model, an
        unknown name, another shape); nothing changes. `begin` opens the transaction."""
        for spec in specs:
            name = spec.name[len(DRAFT_PREFIX) :]
            if not self._params:
                raise ValueError(
                    f"tensors: {spec.name!r} is a draft model's tensor, but the engine has "
                    "no draft model (speculative_config method 'draft_model')"
                )
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"tensors: the draft model has no parameter {name!r}")
            if tuple(param.shape) != tuple(spec.shape):
                raise ValueError(
                    f"tensors: {spec.name!r} is {tuple(spec.shape)}, the draft model's "
                    f"parameter is {tuple(param.shape)}"
                )
        if begin and self._saved is None:
            self._saved = {}

    @torch.no_grad()
    def load(self, tensors: dict[str, Any]) -> None:
        """Copy checked `draft.*` tensors in, saving the old values first."""
        for full_name, tensor in tensors.items():
            param = self._params[full_name[len(DRAFT_PREFIX) :]]
            if self._saved is not None and full_name not in self._saved:
                self._saved[full_name] = param.detach().clone()
            param.copy_(torch.as_tensor(tensor).to(param.dtype))

    @torch.no_grad()
    def rollback(self) -> None:
        saved, self._saved = self._saved, None
        for full_name, old in (saved or {}).items():
            self._params[full_name[len(DRAFT_PREFIX) :]].copy_(old)

    def finish(self) -> None:
        self._saved = None
