"""The OpenAI-compatible HTTP app: ``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Handlers turn a request into rows (``answers.choices``), hand them to the decoding thread
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.ledger import Speculated
from ..model.loading import context_length
from ..version import __version__
from .engine import Engine
from .engine import Request as Work
from .protocol import APIError, ChatRequest, CompletionRequest, answer, chunk, new_id, routing_stats, usage, \
    validation_error
from .answers import choices
from .limits import BodyLimit
from .listen import SENT
from .metrics import CONTENT_TYPE
from .settings import ServeSettings

logger = logging.getLogger(__name__)


class Service:
    """What the handlers need: the model's tokenizer and limits, the settings, the decoding thread."""

    def __init__(self, model, tokenizer, settings: ServeSettings, name: str) -> None:
        self.model, self.tokenizer, self.settings, self.name = model, tokenizer, settings, name
        self.context = context_length(model.slm, model.llm)
        self.vocab = model.shared_vocab_size
        self.engine = Engine(model, tokenizer, settings)
        if self.engine.max_context is not None:  # static (captured) slots hold this many tokens per answer
            self.context = min(self.context or self.engine.max_context, self.engine.max_context)
        self.exporter: Callable[[], bytes] | None = None  # a Ray replica's: every replica's metrics (ray_serve.py)

    def health(self) -> dict[str, Any]:
        """``/health``: this process, the path its steps run on and why (eager), and what start-up captured.

        The server listens only once start-up is done, every capture or compilation with it: ``steps`` were captured
        (compiled, under ``--capture compile``) then, in ``seconds``; none is left for the decoding thread's first use.
        """
        report = self.engine.capture_report
        return {"status": "ok", "pid": os.getpid(), "path": report["path"], "why": report.get("why"),
                "steps": report.get("steps", 0), "seconds": round(report.get("seconds", 0.0), 3)}

    def metrics_text(self) -> bytes:
        """``/metrics``'s body: this engine's metrics, or under Ray every replica's, each labelled with its replica."""
        return self.exporter() if self.exporter is not None else self.engine.metrics.text()

    # ------------------------------------------------------------ requests to rows
    def prompts(self, body: CompletionRequest | ChatRequest) -> list[list[int]]:
        """Each prompt's token ids (a chat's as its template renders it). Slow for a long prompt: ``respond`` runs it
        off the event loop, so the other clients' answers go on meanwhile."""
        if isinstance(body, ChatRequest):
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", param="messages")
            from jinja2.exceptions import TemplateError, TemplateSyntaxError  # what apply_chat_template renders with

            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except TemplateSyntaxError:  # a broken template is the server's fault: a 500
                raise
            except TemplateError as err:  # the template's raise_exception: it refuses this conversation
                raise APIError(400, f"This model's chat template refuses these messages ({err}); change them as it "
                                    "asks.", param="messages") from None
            return [self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        ids = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in _prompt_list(body.prompt)]
        if not ids or any(not p for p in ids):
            raise APIError(400, "The prompt is empty; send at least one token of text.", param="prompt")
        if any(t < 0 or t >= self.vocab for p in ids for t in p):
            raise APIError(400, f"prompt holds token ids outside the vocabulary [0, {self.vocab}).", param="prompt")
        return ids

    def check(self, body: CompletionRequest | ChatRequest) -> None:
        """What can be refused before the prompt is tokenised: the model, unsupported options, too many rows."""
        if body.model != self.name:
            raise _no_model(body.model, self.name)
        body.refuse_unsupported()
        prompts = 1 if isinstance(body, ChatRequest) else len(_prompt_list(body.prompt))
        batch = self.settings.max_batch_size
        if prompts * body.n > batch:  # each prompt gives n rows of the batch
            if body.n > batch or prompts == 1:
                raise APIError(400, f"n={body.n} answers exceed this server's batch of {batch} rows; ask for at most "
                                    f"{batch}.", param="n")
            raise APIError(400, f"{prompts} prompts x n={body.n} = {prompts * body.n} answers exceed this server's "
                                f"batch of {batch} rows; send at most {batch // body.n} per request.",
                           param="prompt")

    # ------------------------------------------------------------ answering
    async def respond(self, body: CompletionRequest | ChatRequest, request: Request):
        self.check(body)
        chat = isinstance(body, ChatRequest)
        prompts = await asyncio.to_thread(self.prompts, body)  # tokenising a long prompt must not stall the loop
        rows_prompts, asked = [], []
        for p in prompts:
            for c in choices(self, body, p):
                rows_prompts.append(p)
                asked.append(c)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        work = Work(rows_prompts, asked, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        self.engine.submit(work)
        rid = new_id("chatcmpl" if chat else "cmpl")
        prompt_tokens = sum(len(p) for p in prompts)
        routing = {"threshold": asked[0].settings.threshold, "budget": asked[0].settings.llm_budget}
        if body.stream:
            stream = self._stream(chat, rid, work, events, prompt_tokens, routing, body.include_usage, request)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts, reasons = [""] * work.rows, [""] * work.rows
        generated = llm = 0
        ended = []
        try:
            for event in await self._collect(work, events, request):
                if event[0] == "text":
                    texts[event[1]] += event[2]
                else:
                    reasons[event[1]], generated, llm = event[2], generated + event[3], llm + event[4]
                    ended.append(event)
        finally:
            self.engine.cancel(work)  # a no-op once every row ended
        self._end_when_sent(work, request)
        return answer(chat, rid, self.name, texts, reasons, usage(prompt_tokens, generated, self._speculation(ended)),
                      routing_stats(llm, generated, **routing))

    def _speculation(self, ended: list[tuple]) -> dict[str, int] | None:
        """What speculation did for the answers of these end events (summed), where the server speculates."""
        if not self.engine.policy.speculate:  # (the pair may not speculate whatever the flag says)
            return None
        counts = [event[5].as_dict() for event in ended if event[5] is not None]
        return {name: sum(c[name] for c in counts) for name in Speculated().as_dict()}

    def _end_when_sent(self, work: Work, request: Request) -> None:
        """``work`` is completed once its answer has left the server (``listen.Sent``), cancelled where its
        connection closes first; where the server cannot tell (no ``Sent``: a Ray proxy's), completed now."""
        sent, metrics = request.scope.get(SENT), self.engine.metrics
        if sent is None:
            metrics.request_ended(work, "completed")
        else:
            sent.then(lambda left: metrics.request_ended(work, "completed" if left else "cancelled"))

    async def _collect(self, work: Work, events: asyncio.Queue, request: Request) -> list[tuple]:
        """Every event of a whole answer; a client that goes away meanwhile ends it at once (``respond`` cancels its
        rows), however often its rows emit: a watcher waits for the disconnect beside the events."""
        watcher = asyncio.create_task(_report_disconnect(request, events))
        try:
            got, open_rows = [], work.rows
            while open_rows:
                event = await events.get()
                if event[0] == "gone":
                    raise APIError(499, "The client closed the request.")
                if event[0] == "error":
                    raise event[1]
                got.append(event)
                open_rows -= event[0] == "end"
            return got
        finally:
            watcher.cancel()

    async def _stream(self, chat: bool, rid: str, work: Work, events: asyncio.Queue, prompt_tokens: int,
                      routing: dict, include_usage: bool, request: Request) -> AsyncIterator[str]:
        open_rows, generated, llm, done = work.rows, 0, 0, False
        started, ended = [False] * work.rows, []
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
                ended.append(event)
                last = not open_rows and not include_usage
                extra = {"r2r": routing_stats(llm, generated, **routing)} if last else {}
                yield _sse(chunk(chat, rid, self.name, event[1], reason=event[2], **extra))
            else:
                if include_usage:
                    yield _sse(chunk(chat, rid, self.name, None,
                                     usage=usage(prompt_tokens, generated, self._speculation(ended)),
                                     r2r=routing_stats(llm, generated, **routing)))
            yield "data: [DONE]\n\n"
            done = True
            self._end_when_sent(work, request)
        finally:
            if not done:  # the client went away mid-stream: its rows stop at the next step
                self.engine.cancel(work)
                self.engine.metrics.request_ended(work, "cancelled")  # (where its rows had all ended)


async def _report_disconnect(request: Request, events: asyncio.Queue) -> None:
    """Put ``("gone",)`` into ``events`` once the client disconnects. The body is read already, so the next message
    the server has for this request is the disconnect (uvicorn's receive waits for it; so does a Ray replica's)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - the connection cannot tell: the answer runs to its end, as a stream's would
        return
    events.put_nowait(("gone",))


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts: one text or token list, or a list of them."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]
    return list(prompt)


def _no_model(asked: str, served: str) -> APIError:
    return APIError(404, f"The model {asked!r} does not exist here; this server serves {served!r}.", param="model",
                    code="model_not_found")


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "r2r_hf"}


def _json_body(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (``application/json``, ``*/*+json``)."""
    subtype = (content_type or "").split(";")[0].strip().lower().partition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def add_routes(app: FastAPI, service_of: Callable[[], Service]) -> None:
    """The OpenAI routes and error handlers on ``app``; ``service_of()`` gives the service answering.

    ``build_app`` passes its one service; a Ray Serve replica passes the one it loaded (``ray_serve.py``).
    """
    app.version = __version__  # /openapi.json's
    app.add_middleware(BodyLimit, limit=lambda: service_of().settings.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        content_type = request.headers.get("content-type")
        if request.method == "POST" and not _json_body(content_type):
            # Refused, not read as JSON: a browser sends text/plain to any address without a CORS preflight, so a
            # web page the operator visits could otherwise drive a loopback server (FastAPI's strict_content_type).
            return _error_response(APIError(415, f"The body was sent as {content_type or 'no content type'!r}, not "
                                                 "JSON; send it with the header 'Content-Type: application/json'."))
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
        return service_of().health()

    # Behind the API key when one is set (request counts and latencies are the operator's business; a Prometheus
    # scrape config sends the key with ``authorization: {credentials: KEY}``).
    @app.get("/metrics", dependencies=[Depends(authorised)])
    async def metrics() -> Response:
        # Rendered off the event loop: however long a scrape takes, the streams and /health go on meanwhile.
        return Response(await asyncio.to_thread(service_of().metrics_text), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(service_of().name)]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorised)])  # a Hub id holds a slash
    async def retrieve_model(model: str) -> dict[str, Any]:
        if model != service_of().name:
            raise _no_model(model, service_of().name)
        return _model_card(model)

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
