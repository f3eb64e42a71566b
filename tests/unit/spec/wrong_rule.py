"""Not collected by pytest: shows that the chi-square tests of test_speculative_sampling.py
(draft model) and test_mtp.py (MTP) fail when the runner verifies drafts drawn from q by a
wrong rule. Each rule replaces `kernels.sampling.speculative_accept` (the sampler calls it through
the module) and the engine test's check runs again; a wrong rule must give a p-value far
below the test's 1e-3.

    .venv/bin/python -m tests.unit.spec.wrong_rule
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from raylane.kernels import sampling

from tests.unit.spec.helpers import make_loopy_llama, sharpened_copy

RIGHT = sampling.speculative_accept


def resample_from_p(p, q, draft, key, ctr0, ctr1):
    """min(1, p/q), but a rejected position draws from p (not the residual)."""
    p = p / p.sum(dim=-1, keepdim=True)
    row_key, row_ctr = sampling.philox2x32(key, ctr0, ctr1)
    u = sampling.philox_uniform(row_key, row_ctr, torch.full_like(row_key, 1 << 30))
    keep = u * q.gather(1, draft[:, None])[:, 0].double() < p.gather(1, draft[:, None])[:, 0]
    return torch.where(keep, draft, sampling.sample_race(p, key, ctr0, ctr1))


def always_accept(p, q, draft, key, ctr0, ctr1):
    """Every draft kept: the output is q's distribution where drafted."""
    return draft


def point_mass_rule(p, q, draft, key, ctr0, ctr1):
    """The target's own draw (what n-gram drafts use): exact for any draft, so it passes;
    it only accepts less than min(1, p/q). A control, not a wrong rule."""
    return sampling.sample_race(p, key, ctr0, ctr1)


def main() -> None:
    from tests.unit.spec import test_speculative_sampling as t
    from tests.unit.spec.test_mtp import mtp_sampled_check

    with tempfile.TemporaryDirectory() as tmp:
        bigram = make_loopy_llama(Path(tmp) / "bigram", attention_scale=0.0)
        sharp = sharpened_copy(bigram, Path(tmp) / "sharp")
        for rule in (RIGHT, resample_from_p, always_accept, point_mass_rule):
            sampling.speculative_accept = rule
            p_value, dof, tap, _ = t.draft_model_check(bigram, sharp)
            rate = tap.num_accepted / tap.num_draft_tokens
            print(f"draft_model {rule.__name__:>18}: p-value {p_value:.3g} (dof {dof}), ", end="")
            print(f"accepted {rate:.2f}")
        from tests.unit.spec.test_mtp import biased_copy
        from tests.unit.test_mtp_layers import make_deepseek_v3_with_mtp

        mtp = biased_copy(make_deepseek_v3_with_mtp(Path(tmp) / "ds")[0], f"{tmp}/biased")
        for rule in (RIGHT, resample_from_p, always_accept):
            sampling.speculative_accept = rule
            p_value, dof, tap = mtp_sampled_check(mtp)
            rate = tap.num_accepted / tap.num_draft_tokens
            print(
                f"mtp {rule.__name__:>16}: p-value {p_value:.3g} (dof {dof}), accepted {rate:.2f}"
            )
        sampling.speculative_accept = RIGHT


if __name__ == "__main__":
    main()
