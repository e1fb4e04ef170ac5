"""Parsing and checking OpenAI request bodies into a GenerationRequest (pure, no I/O).

Every rejection names the offending field, so clients can fix what they sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from splitflash.services.gateway.api_errors import ApiError, invalid

ROLES = ("system", "user", "assistant", "tool")
MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # "completion" | "chat"
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int | None  # None: up to the context and the gateway default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    spec_enabled: bool = True
    block_size: int | None = None
    model: str = ""
    extra: dict = field(default_factory=dict)


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def _number(body: dict, name: str, default, lo: float, hi: float, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise invalid(name, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not lo <= value <= hi:
        raise invalid(name, f"must be between {lo} and {hi}, got {value}")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"must be a boolean, got {value!r}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "must be a non-empty string or a list of non-empty strings")
    if len(stop) > 4:
        raise invalid("stop", f"at most 4 stop strings, got {len(stop)}")
    return tuple(stop)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "is required", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(where, "must be an object with role and content")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if isinstance(content, list):  # OpenAI content parts: text only
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if not parts or not all(isinstance(p, str) for p in parts):
                raise invalid(f"{where}.content", "only text content parts are supported")
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _speculative(body: dict, max_block: int) -> tuple[bool, int | None]:
    spec = body.get("speculative")
    if spec is None:
        return True, None
    if not isinstance(spec, dict):
        raise invalid("speculative", "must be an object {enabled, block_size}")
    unknown = set(spec) - {"enabled", "block_size"}
    if unknown:
        raise invalid("speculative", f"unknown field(s) {sorted(unknown)}")
    enabled = _bool(spec, "enabled", True)
    block = spec.get("block_size")
    if block is not None:
        block = _number(spec, "block_size", None, 2, max_block, integer=True)
    return enabled, block


def parse_request(body: dict, kind: str, model_name: str, max_block: int) -> GenerationRequest:
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise invalid("model", "must be a string")
    if model not in (model_name, ""):
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
        )
    if _number(body, "n", 1, 1, 1, integer=True) != 1:  # pragma: no cover - range says 1
        raise invalid("n", "only n=1 is supported")
    prompt = messages = None
    if kind == "chat":
        messages = _messages(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if prompt is None:
            raise invalid("prompt", "is required", "missing_required_parameter")
        if not isinstance(prompt, str):
            raise invalid("prompt", "must be a string (or a list holding one string)")
        if not prompt:
            raise invalid("prompt", "must not be empty")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _number(
            body,
            "max_tokens" if "max_tokens" in body else "max_completion_tokens",
            None,
            1,
            1 << 20,
            integer=True,
        )
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid("stream_options", "must be an object")
    enabled, block = _speculative(body, max_block)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("seed", f"must be an integer, got {seed!r}")
    return GenerationRequest(
        kind=kind,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
        top_k=int(_number(body, "top_k", 0, 0, 1 << 20, integer=True)),
        seed=seed,
        stop=_stop(body),
        stream=_bool(body, "stream", False),
        include_usage=_bool(stream_options, "include_usage", False),
        spec_enabled=enabled,
        block_size=block,
        model=model_name,
    )
