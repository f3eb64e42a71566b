"""Postprocessor: folds a step's result into the sequences, and ends requests.

With async scheduling the next step was planned before this one's result arrived, assuming
every running sequence goes on; reconciling happens here. A sequence that ended since the
step was launched (aborted, failed, stale, or finished by the step before) gets nothing from
it: its work in the step is dropped, and so is whatever a later step in flight computes for
it. A sequence that finishes here is released at once; the step after it (already on its way)
computed one more token for it, which is dropped in turn. So no token beyond the serial
engine's reaches an output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from raylane.actors.engine.detokenizer import StopChecker
from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.planner import StepPlanner
from raylane.actors.engine.request import Request
from raylane.actors.engine.scheduler import ScheduledSeq, Scheduler
from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.spec.speculation import Speculation
from raylane.actors.engine.stats import EngineStats
from raylane.actors.engine.weight_sync import too_stale
from raylane.actors.runner.plan import StepResult

if TYPE_CHECKING:
    from llguidance import LLMatcher


class Postprocessor:
    def __init__(
        self,
        scheduler: Scheduler,
        planner: StepPlanner,
        stop_checker: StopChecker,
        stats: EngineStats,
        requests: dict[str, Request],
        weight_version: Callable[[], int],
        speculation: Speculation,
    ):
        self.scheduler = scheduler
        self.planner = planner
        self.stop_checker = stop_checker
        self.stats = stats
        self.requests = requests
        self.weight_version = weight_version
        self.speculation = speculation  # folds in what each row verified

    def apply(self, scheduled: list[ScheduledSeq], result: StepResult) -> list[EngineCoreOutput]:
        """Fold a step's result in; returns the outputs of the requests it advanced."""
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for i, item in enumerate(scheduled):
            seq = item.seq
            if seq.finish_reason is not None:
                continue  # ended while the step ran: its work is dropped
            self.scheduler.confirm(item)
            seq.prompt_logprobs.extend(result.prompt_logprobs[i])
            if result.prompt_ranks:
                seq.prompt_ranks.extend(result.prompt_ranks[i])
            if result.routed_experts[i] is not None:
                seq.routing_parts.append(result.routed_experts[i])
            if result.indexer_topk and result.indexer_topk[i] is not None:
                seq.indexer_parts.append(result.indexer_topk[i])
            token = result.token_ids[i]
            if token is None:
                if seq.seq_id in result.skipped_seq_ids:
                    self._skipped(item)
                continue
            request = self.requests[seq.request_id]
            for tok, logprob, top, kept in _tokens(result, i):  # one, or 1 + accepted drafts
                self._append(seq, request, tok, logprob, top, kept, now)
                if seq.finish_reason is not None:
                    break  # a stop inside an accepted run: the tokens after it are dropped
            self.speculation.verified(item, result, i)
            if seq.finish_reason is not None and not seq.is_finished:
                self.release(seq)
            touched[seq.request_id] = request
        return self.outputs(list(touched.values()))

    def _skipped(self, item: ScheduledSeq) -> None:
        """Its grammar mask was late (actors/runner/mask_board.py): it sampled nothing, and
        its last position is computed again. The runners now hold exactly its known tokens:
        a step in flight planned before this skip carries a placeholder for the token never
        sampled, which they drop."""
        seq = item.seq
        seq.num_pending = max(0, seq.num_pending - 1)
        self.stats.grammar_skips += 1
        if seq.num_preemptions == item.preemptions:
            seq.num_computed_tokens -= 1
            self.planner.rolled_back(seq, len(seq.token_ids))

    def _append(self, seq: Sequence, request: Request, token, logprob, top, kept, now) -> None:
        self.stats.token(request, now)
        seq.append_token(token, logprob, top, self.weight_version(), kept)
        self.stop_checker.check(seq, request.detokenize(seq))
        if seq.matcher is not None:
            self._advance_grammar(seq, seq.matcher, request, token)

    def _advance_grammar(
        self, seq: Sequence, matcher: LLMatcher, request: Request, token: int
    ) -> None:
        """The grammar takes the token; a complete grammar (nothing may follow) ends the
        sequence even under ignore_eos, since its next mask would allow no token. A grammar
        that rejects the token (e.g. text it spelled as a special token it then refuses) ends
        the request with an error, never with a "stop" whose text is not in the language."""
        if not matcher.consume_token(token) or matcher.is_error():
            request.error = (
                f"the structured-output grammar rejected token {token}: "
                f"{matcher.get_error() or 'not allowed'}"
            )
            seq.finish_reason = None
            self.end(request, "error", keep_routing=False)
        elif seq.finish_reason is None and matcher.is_stopped():
            seq.finish_reason = "stop"

    def fail(self, scheduled: list[ScheduledSeq], error: BaseException) -> list[EngineCoreOutput]:
        """The step raised: every request in it ends with finish reason "error"."""
        snapshots = self.scheduler.blocks.snapshots
        if snapshots is not None:  # its snapshot saves and copies may not have run
            snapshots.clear()
        failed: dict[str, Request] = {}
        for item in scheduled:
            request = self.requests.get(item.seq.request_id)
            if item.seq.finish_reason is None and request is not None:
                failed[request.request_id] = request
        for request in failed.values():
            request.error = f"the engine step failed: {error}"
            self.end(request, "error", keep_routing=False)
        return self.outputs(list(failed.values()))

    def end(self, request: Request, reason: str, keep_routing: bool = True) -> None:
        """End every sequence of the request still running, with `reason`."""
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
                self.release(seq, keep_routing)

    def release(self, seq: Sequence, keep_routing: bool = True) -> None:
        """A finished sequence: keep its routing record, free its blocks, tell the runners."""
        if keep_routing and seq.params.return_routed_experts and seq.routing_parts:
            # every position but the last sampled token was fed through the model
            seq.routed_experts = np.concatenate(seq.routing_parts)[: len(seq.token_ids) - 1]
            seq.routing_parts = []
        if keep_routing and seq.params.return_indexer_topk and seq.indexer_parts:
            seq.indexer_topk = np.concatenate(seq.indexer_parts)[: len(seq.token_ids) - 1]
            seq.indexer_parts = []
        self.scheduler.finish(seq)
        self.planner.forget(seq)
        self.speculation.forget(seq)

    def abort(self, ids: list[str]) -> list[EngineCoreOutput]:
        """Stop the requests (ids not running are skipped) and free their blocks; returns
        their final ("abort") outputs."""
        outputs = []
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            self.stats.finished["abort"] += 1
            self.end(request, "abort", keep_routing=False)
            outputs.append(request.delta(self.weight_version()))
        return outputs

    def end_stale(self) -> list[EngineCoreOutput]:
        """Requests whose tokens would now span more than their max_weight_lag versions end
        with their partial output, finish reason "stale"."""
        version = self.weight_version()
        stale = [r for r in self.requests.values() if too_stale(r, version)]
        for request in stale:
            self.end(request, "stale")
        return self.outputs(stale)

    def outputs(self, touched: list[Request]) -> list[EngineCoreOutput]:
        """What the requests gained since their last output; finished ones are counted and
        forgotten."""
        outputs = [r.delta(self.weight_version()) for r in touched]
        for r in touched:
            if r.finished:
                self.stats.request_finished(r, time.monotonic())
                del self.requests[r.request_id]
        return outputs


def _tokens(result: StepResult, i: int):
    """Entry i's tokens as (token, logprob, top logprobs, kept mass): the first, then a verify
    row's further ones."""
    yield (result.token_ids[i], result.logprobs[i], result.top_logprobs[i], result.kept_mass[i])
    extra = result.extra[i] if result.extra else None
    if extra is not None:
        yield from zip(extra.token_ids, extra.logprobs, extra.top_logprobs, extra.kept_mass)
