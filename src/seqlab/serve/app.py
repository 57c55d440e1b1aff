"""The HTTP side (Starlette, async): OpenAI routes over the engine, server-sent events for streams.

Each request handler turns a validated body into prompt ids, submits a ``Request`` to the engine, and awaits the
events the engine thread hands back through ``loop.call_soon_threadsafe``. A client that goes away cancels its
request (the engine frees its slot at the next step); nothing a single request does can stop the server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from seqlab.generate.chat import chat_prompt_ids, end_ids, turn_end_ids
from seqlab.serve import protocol
from seqlab.serve.protocol import APIError
from seqlab.serve.scheduler import Engine, Event, NotAcceptingError, QueueFullError, Request

_POLL_S = 0.25  # how often a non-streaming handler checks whether its client is still connected
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; a chat reply may fill the context


def create_app(engine: Engine, tokenizer, model_name: str,
               encode_prompt: Callable[[str], list[int]] | None = None) -> Starlette:
    """``encode_prompt`` turns a completion's prompt into ids (default ``tokenizer.encode``); ``seqlab serve`` passes
    the rule ``seqlab generate`` uses, so both read a prompt alike (a seqlab checkpoint's starts with BOS)."""
    created = int(time.time())
    encode_prompt = encode_prompt or tokenizer.encode
    chat_stop_ids = turn_end_ids(tokenizer, engine.model.config)
    eos = end_ids(tokenizer, engine.model.config)  # a completion ends where `seqlab generate`'s does
    # no token holds more UTF-8 bytes than this (a special token's text included), so a text longer than the
    # context times it cannot fit, however it tokenizes: refused before tokenizing, which would block every client
    # (5 MB of prompt: 7.9 s) for an answer known in advance
    longest_token = max([*tokenizer.byte_lengths(),
                         *(len((tokenizer.token(i) or "").encode("utf-8")) for i in tokenizer.special_ids)], default=1)
    text_limit = engine.context * max(longest_token, 1)
    # a body holds that text at most 6 bytes a character (JSON's \uXXXX) plus the fields around it: anything larger
    # is refused as it arrives, before it fills memory (a 400 MiB body was read whole: +770 MiB, streams stalled)
    body_limit = 6 * text_limit + (1 << 20)

    def _check_size(param: str, texts: list[str]) -> None:
        size = sum(len(t.encode("utf-8")) for t in texts)
        if size > text_limit:
            raise APIError(400, f"{param}: {size} bytes of text cannot fit the context of {engine.context} tokens "
                                f"(no token here holds more than {longest_token} bytes)", param=param,
                           code="context_length_exceeded")

    async def health(_: HTTPRequest) -> JSONResponse:
        return JSONResponse({"status": "ok", **engine.stats()})

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "seqlab"}

    async def models(_: HTTPRequest) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(http: HTTPRequest) -> JSONResponse:
        _check_model(http.path_params["name"])
        return JSONResponse(card)

    async def chat(http: HTTPRequest):
        body = protocol.parse_chat(await _json(http, body_limit))
        _check_model(body.model)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        _check_size("messages", [m["content"] for m in body.messages])
        try:  # off the event loop: many short messages pass the size check and still take seconds to render
            ids = await asyncio.to_thread(chat_prompt_ids, tokenizer, body.messages)
        except ValueError as e:
            raise protocol.bad("messages", f"the chat template cannot render them: {e}") from e
        return await _run(http, body, ids, chat_stop_ids, chat=True, param="messages")

    async def completions(http: HTTPRequest):
        body = protocol.parse_completion(await _json(http, body_limit))
        _check_model(body.model)
        _check_size("prompt", [body.prompt])
        ids = await asyncio.to_thread(encode_prompt, body.prompt)
        return await _run(http, body, ids, eos, chat=False, param="prompt")

    def _check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    async def _run(http: HTTPRequest, body: protocol.GenerationRequest, ids: list[int], stop_ids: list[int],
                   chat: bool, param: str):
        # a completion's default of 16 is asked for as if sent (OpenAI refuses it too); a chat's fills the context
        asked = body.max_tokens if body.max_tokens is not None else None if chat else COMPLETION_MAX_TOKENS
        if asked is not None and len(ids) < engine.context < len(ids) + asked:
            raise APIError(400, f"{param}: the context holds {engine.context} tokens, and this request asks for "
                                f"{len(ids) + asked} ({len(ids)} of prompt, max_tokens {asked}); "
                                f"lower max_tokens or the prompt", param=param, code="context_length_exceeded")
        max_tokens = asked or engine.context
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        req = Request(ids, max_tokens, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), tokenizer,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                      stop=body.stop, stop_ids=[] if body.ignore_eos else stop_ids, strip=chat)
        try:
            engine.submit(req)
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full") from e
        except NotAcceptingError as e:
            raise APIError(503, str(e)) from e
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param, code="context_length_exceeded") from e
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            return StreamingResponse(_sse(req, events, rid, body, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(http, req, events, rid, body, chat)

    async def _collect(http, req, events, rid, body, chat) -> JSONResponse:
        parts = []
        checked = time.monotonic()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), _POLL_S)
                except asyncio.TimeoutError:
                    ev = None
                if time.monotonic() - checked >= _POLL_S:  # events may never pause: check by the clock
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        req.cancel()
                        return JSONResponse({}, status_code=499)
                if ev is None:
                    continue
                if ev.error:
                    raise APIError(500, ev.error)
                parts.append(ev.text)
                if ev.finish_reason:
                    break
        finally:
            req.cancel()  # a no-op once the request is done; frees the slot if this handler was cancelled
        use = protocol.usage(len(req.prompt_ids), ev.completion_tokens)
        text = "".join(parts)
        if chat:
            return JSONResponse(protocol.chat_response(rid, body.model, text, ev.finish_reason, use))
        return JSONResponse(protocol.completion_response(rid, body.model, text, ev.finish_reason, use))

    async def _sse(req, events, rid, body, chat) -> AsyncIterator[str]:
        try:
            if chat:
                yield _data(protocol.chat_chunk(rid, body.model, {"role": "assistant", "content": ""}, None))
            while True:
                ev = await events.get()
                if ev.error:
                    yield _data(APIError(500, ev.error).body())
                    break
                if ev.text or ev.finish_reason:
                    if chat:
                        delta = {"content": ev.text} if ev.text else {}
                        yield _data(protocol.chat_chunk(rid, body.model, delta, ev.finish_reason))
                    else:
                        yield _data(protocol.completion_response(rid, body.model, ev.text, ev.finish_reason, None))
                if ev.finish_reason:
                    if body.include_usage:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        use = protocol.usage(len(req.prompt_ids), ev.completion_tokens)
                        yield _data(protocol.usage_chunk(rid, body.model, obj, use))
                    break
            yield "data: [DONE]\n\n"
        finally:
            req.cancel()  # the client went away (or the stream ended): free the slot

    async def on_api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def on_http_error(http: HTTPRequest, exc: HTTPException) -> JSONResponse:
        """An unknown route or method answers in the API's error form too, which clients parse."""
        what = (f"no route {http.url.path}; this server has /v1/completions, /v1/chat/completions, /v1/models and "
                "/health") if exc.status_code == 404 else f"{http.method} {http.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, what).body(), status_code=exc.status_code,
                            headers=exc.headers)  # a 405 says which methods are allowed

    async def on_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}").body(), status_code=500)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                        Exception: on_error})


async def _json(http: HTTPRequest, limit: int):
    """The request's JSON body, read up to ``limit`` bytes (413 past it: a declared length is refused at once)."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({declared} bytes) is larger than this server takes ({limit} bytes: "
                            f"more text than the context holds)")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than this server takes ({limit} bytes: more text than "
                                f"the context holds)")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:  # ValueError: also an integer of 5000 digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    try:  # JSON's \ud800-\udfff escapes decode to lone surrogates, which are no text: a tokenizer cannot read them
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"the request holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a}), which is "
                            "not a character; send the text as valid Unicode") from e
    return body


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
