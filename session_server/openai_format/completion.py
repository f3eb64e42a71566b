"""The (legacy) completions response and stream chunks, with `echo` (the prompt before each
choice, its logprobs too when asked)."""

from __future__ import annotations

import dataclasses
from itertools import accumulate

from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
)
from raylane.session_server import formatting as fmt
from raylane.session_server.openai_format.formatter import Formatter
from raylane.session_server.streaming import Delta, PromptSeen


@dataclasses.dataclass(frozen=True)
class Echo:
    """`echo: true` (/v1/completions): each choice's text and logprobs start with its prompt's."""

    texts: list[str]  # the prompt text as sent (decoded when sent as token ids), by prompt index
    # max_tokens 0: the engine needs max_tokens >= 1, so the request runs with 1 and the token
    # it generates is dropped here (no text, logprob or usage; finish reason "length")
    prompt_only: bool = False


class CompletionFormatter(Formatter):
    chunk_object = "text_completion"

    def __init__(self, *args, echo: Echo | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._echoed: set[int] = set()  # streamed choices whose prompt part went out

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        finals = {i: self._shown(out) for i, out in finals.items()}
        self._saw(list(finals.values()))
        choices = [self._choice(idx, out, c) for idx, out, c in self._choices(finals)]
        return {
            **self._head("text_completion"),
            "system_fingerprint": None,
            "choices": choices,
            "usage": fmt.usage([finals[i] for i in sorted(finals)]),
        }

    def _choice(self, idx: int, out: RequestOutput, c: CompletionOutput) -> dict:
        prefix, prefix_lp = self._prompt_part(idx // self.params.n, out)
        choice = {
            "index": idx,
            "text": prefix + c.text,
            "logprobs": _joined(
                prefix_lp, self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, len(prefix))
            ),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if self.body.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
        if getattr(self.body, "prompt_logprobs", None) is not None:  # completions only
            choice["prompt_logprobs"] = fmt.vllm_prompt_logprobs(self.namer, out)
        return self._extras(choice, c, c.token_ids)

    def chunks(self, i: int, out: EngineCoreOutput) -> list[dict]:
        out = self._shown(out)
        deltas = {idx: (c, d) for idx, c, d in self._deltas(i, out)}
        choices = []
        for c in out.outputs:
            idx = i * self.params.n + c.index
            # with echo, a choice's first chunk carries its prompt (vLLM's stream does the same)
            echo_now = self.echo is not None and idx not in self._echoed
            if idx in deltas or echo_now:
                self._echoed.add(idx)
                c, d = deltas.get(idx, (c, None))
                choices.append(self._stream_choice(i, idx, out, c, d, echo_now))
        return [self._chunk([ch]) for ch in choices]

    def _stream_choice(
        self,
        i: int,
        idx: int,
        out: EngineCoreOutput,
        c: SampleDelta,
        d: Delta | None,
        echo_now: bool,
    ) -> dict:
        if d is None:  # the prompt part alone: the choice has nothing new yet
            none: list | None = [] if c.logprobs is not None else None
            d = Delta("", [], none, none, 0, False, False)
        prefix, prefix_lp = self._prompt_part(i, self.seen[i]) if echo_now else ("", None)
        shift = len(self.echo.texts[i]) if self.echo is not None else 0
        lp = self._logprobs(d.token_ids, d.logprobs, d.top_logprobs, d.text_offset + shift)
        choice = {
            "index": idx,
            "text": prefix + d.text,
            "logprobs": _joined(prefix_lp, lp),
            "finish_reason": c.finish_reason if d.finished else None,
            "stop_reason": c.stop_reason if d.finished else None,
        }
        if self.body.return_token_ids and (echo_now if self.echo is not None else d.first):
            choice["prompt_token_ids"] = self.seen[i].prompt_token_ids
        return self._extras(choice, c, d.token_ids)

    def _prompt_part(self, i: int, out: RequestOutput | PromptSeen) -> tuple[str, dict | None]:
        """What echo puts before prompt i's completion: its text, and its logprobs when asked."""
        if self.echo is None:
            return "", None
        if self.params.logprobs is None:
            return self.echo.texts[i], None
        return self.echo.texts[i], _prompt_logprobs(self.namer, out)

    def _shown(self, out):
        """`out` (a cumulative output or a delta) as the response shows it."""
        return _prompt_only(out) if self.echo is not None and self.echo.prompt_only else out

    def _logprobs(self, ids, logprobs, tops, offset: int) -> dict | None:
        if logprobs is None:
            return None
        return fmt.completion_logprobs(self.namer, ids, logprobs, tops, self.num_top, offset)


def _prompt_logprobs(tokenizer, out: RequestOutput | PromptSeen) -> dict:
    """The legacy `logprobs` of the prompt tokens. The first token has none (nothing precedes
    it); each later one's top_logprobs holds the top-N and the token itself, as vLLM's do."""
    ids = out.prompt_token_ids
    entries = list(out.prompt_logprobs or [])
    entries += [None] * (len(ids) - len(entries))  # ended (deadline) before its prefill ran
    tokens = [fmt.token_text(tokenizer, t) for t in ids]
    tops = [
        None
        if e is None
        else {
            fmt.token_text(tokenizer, a): fmt.finite(lp)
            for a, lp in sorted(e.items(), key=lambda kv: -kv[1])
        }
        for e in entries
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else fmt.finite(e[t]) for t, e in zip(ids, entries)],
        "top_logprobs": tops,
        "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=0)),
    }


def _prompt_only(out):
    """`out` (a `RequestOutput` or an `EngineCoreOutput`) without its generated token (see
    `Echo.prompt_only`)."""
    samples = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            weight_versions=[],
            stop_reason=None,
            logprobs=None if c.logprobs is None else [],
            top_logprobs=None if c.top_logprobs is None else [],
            kept_mass_logprobs=None if c.kept_mass_logprobs is None else [],
            finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason,
        )
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=samples)


def _joined(head: dict | None, tail: dict | None) -> dict | None:
    """Two legacy logprobs objects as one (the prompt's, then the completion's)."""
    if head is None or tail is None:
        return tail
    return {key: head[key] + tail[key] for key in head}
