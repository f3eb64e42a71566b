"""ResultBuilder: the sampling rank's `StepResult` of a step: sampled tokens (and a verify
row's accepted drafts) and prompt logprobs. (Features add theirs: replay records, drafts.)
"""

from __future__ import annotations

import torch
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.mask_board import SKIP
from raylane.actors.runner.plan import ExtraTokens, StepResult
from raylane.actors.runner.requests import ScheduledRequest
from raylane.actors.runner.sampler import Sampler
from raylane.actors.runner.spec_verify import accept, sampling_rows


class ResultBuilder:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def result(
        self, scheduled: list[ScheduledRequest], step: StepInputs, logits: torch.Tensor
    ) -> StepResult:
        result = StepResult.empty(len(scheduled))
        picks, sampled, firsts = self._draw(scheduled, step, logits)
        for k, i in zip(firsts, picks):
            result.token_ids[i] = sampled.token_ids[k]
            result.logprobs[i] = sampled.logprobs[k]
            result.top_logprobs[i] = sampled.top_logprobs[k]
            result.kept_mass[i] = sampled.kept_mass[k]
            last = k + scheduled[i].num_accepted
            if last > k:  # a verify row's accepted drafts: the target's tokens after them
                more = slice(k + 1, last + 1)
                result.extra[i] = ExtraTokens(
                    sampled.token_ids[more],
                    sampled.logprobs[more],
                    sampled.top_logprobs[more],
                    sampled.kept_mass[more],
                )
            scheduled[i].state.last_sampled = sampled.token_ids[last]
        for i, item in enumerate(scheduled):
            entries, ranks = self._prompt_logprobs(item, step.logits_rows[i], logits)
            result.prompt_logprobs[i], result.prompt_ranks[i] = entries, ranks
        return result

    def draw_only(
        self, scheduled: list[ScheduledRequest], step: StepInputs, logits: torch.Tensor
    ) -> None:
        """A rank that does not report: draw the same tokens as rank 0, to fill placeholders."""
        picks, drawn, firsts = self._draw(scheduled, step, logits, tokens_only=True)
        for k, i in zip(firsts, picks):
            scheduled[i].state.last_sampled = drawn.token_ids[k + scheduled[i].num_accepted]

    def _draw(
        self,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        logits: torch.Tensor,
        tokens_only: bool = False,
    ):
        """Sample the rows whose chunk reaches the end of its sequence: (their indices in
        `scheduled`, the SampleResult, each one's first position in it), or ([], None, [])
        when none does (nor a row whose grammar mask was late: `step.masks`). A verify row
        samples 1 + k positions (see spec_verify)."""
        masks = step.masks
        picks = [
            i
            for i, item in enumerate(scheduled)
            if item.samples and masks.get(item.state.seq_id) is not SKIP
        ]
        if not picks:
            return picks, None, []
        rows, states, proposals = sampling_rows(scheduled, picks, step.logits_rows)
        sampled = self.sampler(
            logits[rows],
            states,
            tokens_only=tokens_only,
            masks=[masks.get(s.seq_id) for s in states],
            proposals=proposals,
        )
        return picks, sampled, accept(scheduled, picks, sampled.token_ids)

    def _prompt_logprobs(
        self, item: ScheduledRequest, rows: tuple[int, int], logits: torch.Tensor
    ) -> tuple[list[dict[int, float]], list[int]]:
        """Each new prompt position's top-N and own logprob, and the prompt token's rank."""
        state = item.state
        first, count = rows
        count -= item.num_sample_rows  # sampling rows are not prompt rows
        if state.params.prompt_logprobs is None or count <= 0:
            return [], []
        lp = self.sampler.rows.log_softmax(logits[first : first + count].float())  # [count, V]
        target0 = state.num_prompt_logprobs_done
        targets = torch.tensor(state.token_ids[target0 : target0 + count], device=lp.device)
        chosen_t = lp.gather(1, targets.unsqueeze(1))  # [count, 1]
        ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()  # vLLM's: 1 + how many beat it
        chosen = chosen_t.squeeze(1).tolist()
        top_v, top_i = lp.topk(state.params.prompt_logprobs, dim=-1)  # k=0 gives empty rows
        entries = []
        for t, c, tv, ti in zip(targets.tolist(), chosen, top_v.tolist(), top_i.tolist()):
            entry = dict(zip(ti, tv))
            entry[t] = c
            entries.append(entry)
        return entries, ranks
