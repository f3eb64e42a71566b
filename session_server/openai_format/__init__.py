"""OpenAI response bodies and stream chunks for one request, chat and (legacy) completions.

A formatter is built per request. A non-streaming response reads each prompt's cumulative
output; a stream reads the engine's deltas as they come, remembering what each choice has sent
(`ChoiceCursor`) and what each prompt told so far (`PromptSeen`, for the usage chunk).
"""

from raylane.session_server.openai_format.chat import ChatFormatter
from raylane.session_server.openai_format.completion import CompletionFormatter, Echo

__all__ = ["ChatFormatter", "CompletionFormatter", "Echo"]
