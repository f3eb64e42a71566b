"""The weight version as every trainer-protocol route answers it (the server's `--trainer-api`
routes): tests assert they all echo the label the trainer gave, or the integer when none."""

from __future__ import annotations

import json

import httpx

PROMPT = [5, 9, 13, 17, 21, 25]
SAMPLING = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


async def versions_everywhere(http: httpx.AsyncClient) -> dict[str, str | list[str]]:
    """Route -> the version it answered: the reads, SGLang's /generate `meta_info`, and vLLM's
    /inference/v1/generate (its JSON answer, and every streamed chunk's, deduplicated)."""
    answers: dict[str, str | list[str]] = {}
    for path in ("/weight_info", "/get_weight_version", "/server_info", "/model_info"):
        answers[path] = (await http.get(path)).json()["weight_version"]
    native = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    answers["/generate"] = (await http.post("/generate", json=native)).json()["meta_info"][
        "weight_version"
    ]
    tokens = {"token_ids": PROMPT, "sampling_params": SAMPLING}
    answer = await http.post("/inference/v1/generate", json=tokens)
    answers["/inference/v1/generate"] = answer.json()["weight_version"]
    chunks = await _stream(http, {**tokens, "stream": True})
    answers["/inference/v1/generate stream"] = sorted({c["weight_version"] for c in chunks})
    return answers


def everywhere_as(text: str) -> dict[str, str | list[str]]:
    """What `versions_everywhere` reads when every route answers `text`."""
    reads = ("/weight_info", "/get_weight_version", "/server_info", "/model_info", "/generate")
    return {
        **dict.fromkeys(reads, text),
        "/inference/v1/generate": text,
        "/inference/v1/generate stream": [text],
    }


async def _stream(http: httpx.AsyncClient, body: dict) -> list[dict]:
    async with http.stream("POST", "/inference/v1/generate", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    return [json.loads(line[len("data: ") :]) for line in lines]
