"""The litestar app: OpenAI-compatible endpoints, health, readiness, metrics, traces."""

from __future__ import annotations

import asyncio
import time
import uuid

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitflash.services.gateway.api_errors import ApiError, invalid
from splitflash.services.gateway.jobs import Failed, Finished, Job, Tokens
from splitflash.services.gateway.requests import GenerationRequest, parse_json, parse_request
from splitflash.services.gateway.responses import chunk, full_response, sse, usage
from splitflash.services.gateway.runtime import GatewayRuntime
from splitflash.services.gateway.textstream import TextStream


def _runtime(request: Request) -> GatewayRuntime:
    return request.app.state.runtime


def _check_auth(request: Request, rt: GatewayRuntime) -> None:
    keys = rt.settings.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer ") or header.removeprefix("Bearer ").strip() not in keys:
        raise ApiError(
            401, "missing or invalid API key (Authorization: Bearer KEY)", None, "invalid_api_key"
        )


def _prompt_ids(rt: GatewayRuntime, req: GenerationRequest) -> list[int]:
    tok = rt.tokenizer
    if req.kind == "chat":
        try:
            text = tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise invalid("messages", f"cannot apply the chat template: {exc}") from None
        return tok(text, add_special_tokens=False).input_ids
    return tok(req.prompt).input_ids


def _make_job(rt: GatewayRuntime, req: GenerationRequest) -> Job:
    ids = _prompt_ids(rt, req)
    limit = rt.settings.max_context
    field = "messages" if req.kind == "chat" else "prompt"
    if len(ids) + 1 > limit:
        raise ApiError(
            400,
            f"{field}: the prompt is {len(ids)} tokens; the context is {limit}",
            field,
            "context_length_exceeded",
        )
    if req.max_tokens is not None and len(ids) + req.max_tokens > limit:
        raise ApiError(
            400,
            f"max_tokens: {req.max_tokens} + prompt {len(ids)} tokens exceeds "
            f"the context of {limit}",
            "max_tokens",
            "context_length_exceeded",
        )
    max_tokens = req.max_tokens or min(rt.settings.default_max_tokens, limit - len(ids))
    return Job(
        request_id=("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex,
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        spec_enabled=req.spec_enabled,
        block_size=req.block_size or rt.settings.block_size,
    )


async def _events(job: Job, stream: TextStream, rt: GatewayRuntime):
    """(text, finish_reason or None) as the request progresses; raises ApiError on failure."""
    while True:
        event = await job.events.get()
        match event:
            case Tokens(ids=ids):
                text = stream.push(ids)
                if stream.stopped:
                    rt.orchestrator.cancel(job)
                    yield text, "stop"
                    return
                if text:
                    yield text, None
            case Finished(reason=reason):
                yield stream.flush(), reason
                return
            case Failed(status=status, message=message, code=code):
                raise ApiError(status, message, None, code)


async def _generate(request: Request, kind: str) -> Response | Stream:
    rt = _runtime(request)
    started = time.monotonic()
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    _check_auth(request, rt)
    req = parse_request(
        parse_json(await request.body()), kind, rt.settings.model_name, rt.settings.max_block_size
    )
    job = _make_job(rt, req)
    stream = TextStream(lambda ids: rt.tokenizer.decode(ids, skip_special_tokens=True), req.stop)
    rt.orchestrator.submit(job)
    rt.metrics.requests.labels(endpoint=endpoint, status="accepted").inc()
    if req.stream:
        return Stream(
            _sse(rt, req, job, stream, started, endpoint),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    parts, finish = [], "length"
    try:
        async for text, reason in _events(job, stream, rt):
            parts.append(text)
            finish = reason or finish
    finally:
        if not job.done:
            rt.orchestrator.cancel(job)
    rt.metrics.request_seconds.labels(endpoint=endpoint).observe(time.monotonic() - started)
    body = full_response(
        kind,
        job.request_id,
        rt.settings.model_name,
        "".join(parts),
        finish,
        len(job.prompt_ids),
        len(job.generated),
        job.stats.to_dict(),
    )
    return Response(body)


async def _sse(rt, req: GenerationRequest, job: Job, stream, started, endpoint):
    model, kind = rt.settings.model_name, req.kind
    try:
        yield sse(chunk(kind, job.request_id, model, "", None, first=True))
        finish = "length"
        try:
            async for text, reason in _events(job, stream, rt):
                if text:
                    yield sse(chunk(kind, job.request_id, model, text, None))
                finish = reason or finish
        except ApiError as exc:
            yield sse(exc.body())
            yield sse("[DONE]")
            return
        last = chunk(kind, job.request_id, model, None, finish)
        if req.include_usage:
            yield sse(last)
            last = {
                **chunk(kind, job.request_id, model, None, None),
                "choices": [],
                "usage": usage(len(job.prompt_ids), len(job.generated)),
            }
        last["speculative_decoding_stats"] = job.stats.to_dict()
        yield sse(last)
        yield sse("[DONE]")
        rt.metrics.request_seconds.labels(endpoint=endpoint).observe(time.monotonic() - started)
    finally:  # the client went away mid-stream: release the request on both services
        if not job.done:
            rt.orchestrator.cancel(job)


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response | Stream:
    return await _generate(request, "completion")


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response | Stream:
    return await _generate(request, "chat")


@get("/v1/models")
async def models(request: Request) -> dict:
    rt = _runtime(request)
    _check_auth(request, rt)
    return {
        "object": "list",
        "data": [
            {
                "id": rt.settings.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "splitflash",
            }
        ],
    }


@get("/v1/requests/{request_id:str}/trace")
async def trace(request: Request, request_id: str) -> dict:
    rt = _runtime(request)
    _check_auth(request, rt)
    job = rt.orchestrator.traces.get(request_id)
    if job is None:
        raise ApiError(404, f"no recent request {request_id!r}", "request_id", "not_found")
    return {
        "request_id": request_id,
        "done": job.done,
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": len(job.generated),
        "speculative_decoding_stats": job.stats.to_dict(),
        "steps": list(job.trace),
    }


@get("/health")
async def health() -> dict:
    return {"status": "ok"}


@get("/ready")
async def ready(request: Request) -> Response:
    rt = _runtime(request)
    status = rt.status()
    return Response(status, status_code=200 if status["ready"] else 503)


@get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_runtime(request).registry), media_type=CONTENT_TYPE_LATEST)


def _api_error(request: Request, exc: ApiError) -> Response:
    rt = request.app.state.runtime
    rt.metrics.requests.labels(endpoint=request.url.path, status=str(exc.status)).inc()
    return Response(exc.body(), status_code=exc.status)


def _http_error(request: Request, exc: HTTPException) -> Response:
    return _api_error(request, ApiError(exc.status_code, str(exc.detail), None, "http_error"))


def _internal_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    return _api_error(
        request, ApiError(500, f"internal error: {type(exc).__name__}", None, "internal")
    )


def create_app(runtime: GatewayRuntime) -> Litestar:
    app = Litestar(
        route_handlers=[completions, chat_completions, models, trace, health, ready, metrics],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        on_startup=[runtime.start],
        on_shutdown=[runtime.stop],
    )
    app.state.runtime = runtime
    return app
