"""The OpenAI-compatible HTTP app: ``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Handlers turn a request into rows (``rows.Sampling``), hand them to the decoding thread
(``engine.Engine``) and turn its events into an answer or Server-Sent Events. Every error is
OpenAI's error body with a 4xx (the client's doing) or 5xx status; nothing a client sends can end
the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..model.loading import context_length
from .engine import Engine
from .engine import Request as Work
from .protocol import APIError, ChatRequest, CompletionRequest, answer, chunk, new_id, routing_stats, usage, \
    validation_error
from .rows import Sampling
from .settings import ServeSettings

logger = logging.getLogger(__name__)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Service:
    """What the handlers need: the model's tokenizer and limits, the settings, the decoding thread."""

    def __init__(self, model, tokenizer, settings: ServeSettings, name: str) -> None:
        self.model, self.tokenizer, self.settings, self.name = model, tokenizer, settings, name
        self.context = context_length(model.slm, model.llm)
        self.vocab = model.shared_vocab_size
        self.default_threshold = settings.threshold if settings.threshold is not None else model.config.threshold
        self.defaults = model.generation_config
        self.engine = Engine(model, tokenizer, settings)

    # ------------------------------------------------------------ requests to rows
    def prompts(self, body: CompletionRequest | ChatRequest) -> list[list[int]]:
        if isinstance(body, ChatRequest):
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", param="messages")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return [self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        ids = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
        if not ids or any(not p for p in ids):
            raise APIError(400, "The prompt is empty; send at least one token of text.", param="prompt")
        if any(t < 0 or t >= self.vocab for p in ids for t in p):
            raise APIError(400, f"prompt holds token ids outside the vocabulary [0, {self.vocab}).", param="prompt")
        return ids

    def samplings(self, body: CompletionRequest | ChatRequest, prompt_tokens: int) -> list[Sampling]:
        chat = isinstance(body, ChatRequest)
        asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        room = None if self.context is None else self.context - prompt_tokens
        if room is not None and room < 1:
            raise APIError(400, f"The prompt has {prompt_tokens} tokens, the models' context is {self.context}; "
                                "shorten it.", param="messages" if chat else "prompt", code="context_length_exceeded")
        default = (self.settings.default_max_tokens or room) if chat else COMPLETION_DEFAULT_MAX_TOKENS
        max_tokens = asked or default or 256
        if room is not None and max_tokens > room:
            if asked:
                raise APIError(400, f"The prompt has {prompt_tokens} tokens; with max_tokens={asked} it exceeds the "
                                    f"models' context of {self.context} tokens. Lower max_tokens or shorten the prompt.",
                               param="max_tokens", code="context_length_exceeded")
            max_tokens = room
        # Unset options take the LLM's generation defaults, as generate() does; temperature 0 means greedy.
        if body.temperature is not None:
            do_sample, temperature = body.temperature > 0, body.temperature
        else:
            do_sample, temperature = bool(self.defaults.do_sample), self.defaults.temperature
        return [Sampling(max_tokens=max_tokens, do_sample=do_sample, temperature=temperature,
                         top_p=body.top_p if body.top_p is not None else self.defaults.top_p,
                         top_k=body.top_k if body.top_k is not None else self.defaults.top_k,
                         stops=tuple(body.stop), seed=None if body.seed is None else body.seed + i,
                         threshold=body.threshold if body.threshold is not None else self.default_threshold,
                         llm_budget=body.llm_budget if body.llm_budget is not None else self.settings.llm_budget)
                for i in range(body.n)]

    def check(self, body: CompletionRequest | ChatRequest) -> None:
        if body.model != self.name:
            raise APIError(404, f"The model {body.model!r} does not exist here; this server serves {self.name!r}.",
                           param="model", code="model_not_found")
        body.refuse_unsupported()

    # ------------------------------------------------------------ answering
    async def respond(self, body: CompletionRequest | ChatRequest, request: Request):
        self.check(body)
        chat = isinstance(body, ChatRequest)
        prompts = self.prompts(body)
        rows_prompts, samplings = [], []
        for p in prompts:
            for s in self.samplings(body, len(p)):
                rows_prompts.append(p)
                samplings.append(s)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        work = Work(rows_prompts, samplings, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        self.engine.submit(work)
        rid = new_id("chatcmpl" if chat else "cmpl")
        prompt_tokens = sum(len(p) for p in prompts)
        routing = {"threshold": samplings[0].threshold, "budget": samplings[0].llm_budget}
        if body.stream:
            stream = self._stream(chat, rid, work, events, prompt_tokens, routing, body.include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts, reasons = [""] * work.rows, [""] * work.rows
        generated = llm = 0
        try:
            for event in await self._collect(work, events, request):
                if event[0] == "text":
                    texts[event[1]] += event[2]
                else:
                    reasons[event[1]], generated, llm = event[2], generated + event[3], llm + event[4]
        finally:
            self.engine.cancel(work)  # a no-op once every row ended
        return answer(chat, rid, self.name, texts, reasons, usage(prompt_tokens, generated),
                      routing_stats(llm, generated, **routing))

    async def _collect(self, work: Work, events: asyncio.Queue, request: Request) -> list[tuple]:
        got, open_rows = [], work.rows
        while open_rows:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise APIError(499, "The client closed the request.") from None
                continue
            if event[0] == "error":
                raise event[1]
            got.append(event)
            open_rows -= event[0] == "end"
        return got

    async def _stream(self, chat: bool, rid: str, work: Work, events: asyncio.Queue, prompt_tokens: int,
                      routing: dict, include_usage: bool) -> AsyncIterator[str]:
        open_rows, generated, llm, done = work.rows, 0, 0, False
        started = [False] * work.rows
        try:
            if chat:  # OpenAI's first chunk of each choice carries the role
                for i in range(work.rows):
                    started[i] = True
                    yield _sse(chunk(chat, rid, self.name, i, first=True))
            while open_rows:
                event = await events.get()
                if event[0] == "error":
                    yield _sse(event[1].body())
                    break
                if event[0] == "text":
                    yield _sse(chunk(chat, rid, self.name, event[1], event[2]))
                    continue
                open_rows -= 1
                generated, llm = generated + event[3], llm + event[4]
                last = not open_rows and not include_usage
                extra = {"r2r": routing_stats(llm, generated, **routing)} if last else {}
                yield _sse(chunk(chat, rid, self.name, event[1], reason=event[2], **extra))
            else:
                if include_usage:
                    yield _sse(chunk(chat, rid, self.name, None, usage=usage(prompt_tokens, generated),
                                     r2r=routing_stats(llm, generated, **routing)))
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:  # the client went away mid-stream: its rows stop at the next step
                self.engine.cancel(work)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def add_routes(app: FastAPI, service_of: Callable[[], Service]) -> None:
    """The OpenAI routes and error handlers on ``app``; ``service_of()`` gives the service answering.

    ``build_app`` passes its one service; a Ray Serve replica passes the one it loaded (``ray_serve.py``).
    """

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return _error_response(validation_error(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return _error_response(APIError(err.status_code, str(err.detail), kind=kind))

    async def authorised(request: Request) -> None:
        key = service_of().settings.api_key
        if key:
            sent = request.headers.get("authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
                raise APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                               kind="authentication_error", code="invalid_api_key")

    async def answered(body: CompletionRequest | ChatRequest, request: Request):
        try:
            return await service_of().respond(body, request)
        except APIError:
            raise
        except Exception as err:  # noqa: BLE001 - one request fails, the server goes on
            logger.exception("request failed")
            raise APIError(500, f"The server failed on this request ({type(err).__name__}: {err}).",
                           kind="server_error") from err

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "pid": os.getpid()}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service_of().name, "object": "model", "created": int(time.time()),
                                            "owned_by": "r2r_hf"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(body: CompletionRequest, request: Request):
        return await answered(body, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)])
    async def chat_completions(body: ChatRequest, request: Request):
        return await answered(body, request)


def build_app(model, tokenizer, settings: ServeSettings, name: str) -> FastAPI:
    """The app serving ``model`` as ``name``; its decoding thread starts and stops with the app."""
    service = Service(model, tokenizer, settings, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.engine.start()
        yield
        await asyncio.to_thread(service.engine.stop, settings.drain_seconds)

    app = FastAPI(title="r2r_hf", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    add_routes(app, lambda: service)
    return app
