"""One turn of a session, planned and then recorded: where the new messages attach (appended,
or after a rollback to a generated checkpoint), the prompt ids the chat template adds for them
(tito), and, once generated, the record the trajectory commits. Nothing here changes the
session: the registry commits the record under the session's lock (router/sessions.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.errors import BadSessionRequest
from raylane.router.messages import Message, normalize_messages
from raylane.router.rollback import TurnPlan, plan_turn
from raylane.router.session import Session, TurnResult
from raylane.router.tito import TemplateSplicer
from raylane.router.trajectory import Trajectory, TurnRecord

ReplyParser = Callable[[CompletionOutput], Message]


def default_reply(output: CompletionOutput) -> Message:
    return {"role": "assistant", "content": output.text}


@dataclass(frozen=True)
class SessionTurn:
    plan: TurnPlan
    prefix_len: int
    prompt_ids: list[int]  # the ids this turn appends
    full_prompt: list[int]
    params: SamplingParams
    tools: list[dict] | None

    @classmethod
    def prepare(
        cls,
        splicer: TemplateSplicer,
        traj: Trajectory,
        messages: list[Message],
        params: SamplingParams | None,
        tools: list[dict] | None,
        template_kwargs: dict[str, Any],
        max_rollback_steps: int,
    ) -> SessionTurn:
        params = session_params(params)
        plan = plan_turn(traj, normalize_messages(messages), max_rollback_steps)
        if plan.keep == 0:
            prompt_ids = splicer.first_turn(plan.new_messages, tools, **template_kwargs)
        else:
            prompt_ids = splicer.next_turn(
                plan.new_messages, traj.records[plan.keep - 1].output_ids, tools, **template_kwargs
            )
        full = traj.tokens(plan.keep)  # a fresh list: the stored ids stay untouched
        prefix_len = len(full)
        full += prompt_ids
        return cls(plan, prefix_len, prompt_ids, full, params, tools)

    def result(
        self, out: RequestOutput, message: Message | None = None, index: int | None = None
    ) -> TurnResult:
        choice = out.outputs[0]
        if choice.routed_experts is not None or choice.indexer_topk is not None:
            # the record keeps the blobs; the reply does not
            choice = dataclasses.replace(choice, routed_experts=None, indexer_topk=None)
        return TurnResult(
            choice, out.weight_version, len(self.full_prompt), self.plan.discarded, message, index
        )

    def record(self, out: RequestOutput, reply: Message) -> TurnRecord:
        """What the trajectory commits for the finished `out`, answered with `reply`."""
        choice = out.outputs[0]
        assert choice.finish_reason is not None  # `out` is finished: its choice says why
        return TurnRecord(
            new_messages=self.plan.new_messages,
            reply=reply,
            params=self.params,
            prefix_len=self.prefix_len,
            prompt_ids=self.prompt_ids,
            output_ids=list(choice.token_ids),
            logprobs=list(choice.logprobs or []),
            finish_reason=choice.finish_reason,
            weight_version=out.weight_version,
            routed_experts=choice.routed_experts,
            tools=self.tools,
            indexer_topk=choice.indexer_topk,
        )


@dataclass(frozen=True)
class OpenTurn:
    """A turn under way: its session (locked for it by `SessionRegistry.open_turn`) and its
    plan, until `SessionRegistry.commit` records it."""

    session: Session
    plan: SessionTurn


def session_params(params: SamplingParams | None) -> SamplingParams:
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise BadSessionRequest(f"params must be SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise BadSessionRequest(
            "n must be 1 in a session: a session records one trajectory", param="n"
        )
    # training needs the logprob of every generated token
    return params if params.logprobs is not None else dataclasses.replace(params, logprobs=0)
