"""The HTTP server: OpenAI's and Anthropic's endpoints over a Gateway, on an event loop of plait's.

    /v1/chat/completions   /v1/completions   /v1/models        OpenAI (base_url .../v1)
    /v1/responses                                              OpenAI's Responses API (plait/serving/responses.py)
    /v1/messages           /v1/messages/count_tokens           Anthropic (base_url ...)
    /generate                                                  SGLang's token-level generate (verl's reward router)
    /sessions/{id}/...     the same, inside a session (one row's rollout while plait trains)
    POST /sessions/{id}/reward  {"reward": float}               the agent's own reward for its row
    GET /health

Every request and connection is bounded (`Limits`): the body's size and JSON depth, the time its head and
body may take to arrive, the connections held at once; past a bound a request is answered in its API's error
shape (or, before a request exists, its connection is closed), and a client that goes away costs only its own
request. Unknown routes and methods are answered in the API's error shape too.

A session is named by its path or by the API key (`Authorization: Bearer <id>`, `x-api-key: <id>`),
so an agent needs nothing but a base URL and a key. Starlette and uvicorn, the stack FastAPI itself
runs on, without FastAPI's request models: plait checks bodies itself (plait/serving/protocol.py) so
that a wrong request gets the API's own error shape and status, never a framework's or a traceback.
The server runs as a task on an existing asyncio loop (the rollout worker's agent-loop thread while
training, so a handler awaits the engine queue directly), bound to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import re
import resource
import socket
import time
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plait.serving import protocol, responses
from plait.serving.gateway import Gateway
from plait.serving.protocol import SESSION_HEADER, ApiError

log = logging.getLogger("plait.serving")


@dataclass
class Limits:
    """What one client may hold of the server, so that none can stall the others or grow it without bound."""
    max_body_bytes: int = 8 << 20    # a request body (413 past it: by its Content-Length before reading, else as it comes)
    max_json_depth: int = 64         # nesting of the body's JSON (400 past it; Python's parser recurses)
    head_timeout_s: float = 30.0     # a request's line and headers, from the connection's start or its last answer
    body_timeout_s: float = 60.0     # a request's body, once its head is in (408 past it)
    max_connections: int = 2048      # past it (or half the open-files limit) the slowest client is dropped

    def __post_init__(self):
        for key in ("max_body_bytes", "max_json_depth", "head_timeout_s", "body_timeout_s", "max_connections"):
            if not getattr(self, key) > 0:
                raise ValueError(f"gateway limit {key}={getattr(self, key)!r}: must be > 0")


def _answer(api: str, err: ApiError) -> JSONResponse:
    # a body refused before it was read whole: the rest must not be read as the connection's next request
    close = {"Connection": "close"} if err.status in (408, 413) else None
    return JSONResponse(err.openai() if api == "openai" else err.anthropic(), status_code=err.status, headers=close)


def handled(api: str):
    """An endpoint's errors in its API's shape: ApiError as itself, anything else a 500 (logged, no traceback out);
    a client gone before its body arrived is nobody's error (there is no one to answer)."""
    def wrap(method):
        async def endpoint(self, request: Request) -> Response:
            try:
                return await method(self, request)
            except ApiError as err:
                return _answer(api, err)
            except ClientDisconnect:
                log.debug("plait gateway: %s %s: the client went away", request.method, request.url.path)
                return Response(status_code=499)
            except Exception as err:  # noqa: BLE001 - never a traceback to the client; the server log has it
                log.exception("plait gateway: %s %s failed", request.method, request.url.path)
                return _answer(api, ApiError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error"))
        return endpoint
    return wrap


class Api:
    """The endpoints over one Gateway."""

    def __init__(self, gateway: Gateway, limits: Limits):
        self.gateway, self.limits = gateway, limits
        self.remembered: dict = {}  # outside sessions: response id -> its conversation, for previous_response_id

    def session_of(self, request: Request):
        """The session a request names by its path or its API key; None outside sessions (plait serve)."""
        gateway, sid = self.gateway, request.path_params.get("sid")
        caller = request.headers.get(SESSION_HEADER)
        if caller in gateway.sessions:  # a process-wide client carries another session's key (protocol.SESSION_HEADER)
            return gateway.session(caller)
        if sid is None:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
            sid = key if key and key in gateway.sessions else (None if gateway.plain is not None else key or None)
        return gateway.session(sid)

    async def body_of(self, request: Request) -> Any:
        """The body as JSON, read within the limits (its size as it streams in, its time, its nesting)."""
        most, size = self.limits.max_body_bytes, request.headers.get("content-length", "")
        too_large = ApiError(413, f"the request body is larger than {most} bytes (this server's limit)")
        if size.isdigit() and int(size) > most:
            raise too_large

        async def read() -> bytes:
            chunks, held = [], 0
            async for chunk in request.stream():
                held += len(chunk)
                if held > most:
                    raise too_large
                chunks.append(chunk)
            return b"".join(chunks)
        try:
            body = await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s") from None
        return parse_json(body, self.limits.max_json_depth)

    @handled("openai")
    async def chat(self, request: Request) -> Response:
        req = protocol.chat_request(await self.body_of(request))
        req.model = req.model or self.gateway.model_name
        choices, prompt = await self.gateway.chat(req, self.session_of(request))
        ids = [[protocol.new_id("call_") for _ in c.calls] for c in choices]
        if req.stream:
            return _sse([f"data: {json.dumps(c)}\n\n" for c in protocol.chat_stream(req, choices[0], prompt, ids[0])]
                        + ["data: [DONE]\n\n"])
        return JSONResponse(protocol.chat_response(req, choices, prompt, ids))

    @handled("openai")
    async def response(self, request: Request) -> Response:
        body, session = await self.body_of(request), self.session_of(request)
        out = await responses.respond(self.gateway, body, session, self.remembered if session is None else session.responses)
        if body.get("stream"):  # a bool: respond checked it
            return _sse([f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in responses.events(out)])
        return JSONResponse(out)

    @handled("openai")
    async def completions(self, request: Request) -> Response:
        encode = lambda text: self.gateway.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        prompt_ids, req = protocol.completion_request(await self.body_of(request), encode, len(self.gateway.tokenizer))
        req.model = req.model or self.gateway.model_name
        choices, prompt = await self.gateway.complete(prompt_ids, req, self.session_of(request))
        body = protocol.completion_response(req, choices, prompt)
        if req.stream:
            return _sse([f"data: {json.dumps(body)}\n\n", "data: [DONE]\n\n"])
        return JSONResponse(body)

    @handled("openai")
    async def generate(self, request: Request) -> Response:
        """SGLang's `/generate`, as verl's reward router answers a GenRM reward function's token-level request."""
        body = await self.body_of(request)
        encode = lambda text: self.gateway.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        prompt_ids, req, logprob = protocol.generate_request(body, encode, len(self.gateway.tokenizer))
        choices, prompt = await self.gateway.complete(prompt_ids, req, self.session_of(request))
        for c in choices:  # SGLang's text: the output ids decoded without special tokens
            c.content = self.gateway.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        rid = str(body.get("rid") or protocol.new_id(""))
        return JSONResponse(protocol.generate_response(choices, prompt, logprob, rid))

    @handled("anthropic")
    async def messages(self, request: Request) -> Response:
        req = protocol.anthropic_request(await self.body_of(request))
        req.model = req.model or self.gateway.model_name
        choices, prompt = await self.gateway.chat(req, self.session_of(request))
        message = protocol.anthropic_response(req, choices[0], prompt, [protocol.new_id("toolu_") for _ in choices[0].calls])
        if req.stream:
            return _sse([f"event: {event}\ndata: {json.dumps(data)}\n\n" for event, data in protocol.anthropic_stream(message)])
        return JSONResponse(message)

    @handled("anthropic")
    async def count_tokens(self, request: Request) -> Response:
        body = await self.body_of(request)
        req = protocol.anthropic_request({"max_tokens": 1, **body} if isinstance(body, dict) else body)
        self.session_of(request)
        return JSONResponse({"input_tokens": self.gateway.count_tokens(req)})

    @handled("openai")
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.gateway.model_name, "object": "model",
                                                         "created": int(time.time()), "owned_by": "plait"}]})

    @handled("openai")
    async def reward(self, request: Request) -> Response:
        session = self.session_of(request)
        body = await self.body_of(request)
        value = body.get("reward", body.get("score")) if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ApiError(400, f"the body must be {{\"reward\": <number>}}, got {str(body)[:80]}", "reward")
        session.reward = float(value)
        return JSONResponse({"session": session.id, "reward": session.reward})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.gateway.model_name, "sessions": len(self.gateway.sessions)})


def make_app(gateway: Gateway, extra: list[Route] | None = None, limits: Limits | None = None) -> Starlette:
    """The gateway's routes, and `extra` ones served beside them (the Tinker API's under /api/v1)."""
    api = Api(gateway, limits or Limits())
    routes = [Route("/health", api.health, methods=["GET"]), Route("/sessions/{sid}/reward", api.reward, methods=["POST"])]
    for prefix in ("", "/sessions/{sid}"):
        routes += [Route(f"{prefix}/v1/chat/completions", api.chat, methods=["POST"]),
                   Route(f"{prefix}/generate", api.generate, methods=["POST"]),
                   Route(f"{prefix}/v1/completions", api.completions, methods=["POST"]),
                   Route(f"{prefix}/v1/responses", api.response, methods=["POST"]),
                   Route(f"{prefix}/v1/messages", api.messages, methods=["POST"]),
                   Route(f"{prefix}/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
                   Route(f"{prefix}/v1/models", api.models, methods=["GET"])]
    return Starlette(routes=routes + (extra or []), exception_handlers={HTTPException: _no_route})


async def _no_route(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405 in the API's error shape (Anthropic's under /v1/messages), naming the route."""
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 405:
        message = f"{route}: method not allowed here (allowed: {(exc.headers or {}).get('Allow', '')})"
    else:
        message = f"{route}: no such route on this server" if exc.status_code == 404 else f"{route}: {exc.detail}"
    api = "anthropic" if "/v1/messages" in request.url.path else "openai"
    return _answer(api, ApiError(exc.status_code, message, kind="invalid_request_error"))


_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_DEPTH = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


def parse_json(body: bytes, max_depth: int) -> Any:
    """A request body's JSON; its nesting is measured first, without recursion (Python's parser recurses and
    raises RecursionError on a deep enough body), and lone surrogates are refused (no tokenizer takes them)."""
    steps = _STRINGS.sub(b"", body).translate(_DEPTH, _NOT_BRACKETS)
    if max(itertools.accumulate(memoryview(steps).cast("b")), default=0) > max_depth:
        raise ApiError(400, f"the request body's JSON is nested deeper than {max_depth} levels")
    try:
        value = json.loads(body)
    except ValueError as err:
        raise ApiError(400, f"the request body is not JSON: {err}") from None
    if re.search(rb"\\u[dD][89a-fA-F]", body):  # a surrogate escape: valid only as half of a pair
        where = _lone_surrogate(value, "")
        if where is not None:  # (a key's path may hold the surrogate itself: written escaped)
            where = where.encode("utf-8", "backslashreplace").decode("utf-8")
            raise ApiError(400, f"{where or 'the body'}: a lone surrogate (\\ud800-\\udfff unpaired) is not valid "
                                "Unicode text", where or None)
    return value


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) in `value` that UTF-8 cannot encode; None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}.{key}".lstrip(".") if isinstance(value, dict) else f"{path}[{key}]"
        found = _lone_surrogate(key, where) if isinstance(key, str) else None
        found = found if found is not None else _lone_surrogate(item, where)
        if found is not None:
            return found
    return None


def _sse(events: list[str]) -> StreamingResponse:
    async def stream():
        for event in events:
            yield event
    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class Server:
    """uvicorn serving `make_app(gateway)` as a task on `loop` (another thread's running loop)."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop, host: str = "127.0.0.1", port: int = 0,
                 extra: list[Route] | None = None, limits: Limits | None = None):
        import uvicorn
        limits = limits or Limits()
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without it a keep-alive client's every request waited ~40 ms (Nagle's
        # algorithm holding the response's second write until the client's delayed ACK)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.bind((host, port))
        except OSError as err:
            self.sock.close()
            raise OSError(f"the gateway cannot listen on {host}:{port}: {err.strerror}") from None
        self.host, self.port, self.loop = host, self.sock.getsockname()[1], loop
        # Out of file descriptors, asyncio's accept loop logs a traceback per try and answers no one: the soft limit
        # is raised to the hard one, and connections are kept well under it.
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
        except (ValueError, OSError):  # macOS: an unlimited hard limit cannot be the soft one
            pass
        # asyncio accepts up to `backlog` connections at once before the cap is applied; the other half is the
        # process's own (a rollout worker's agents, pipes, checkpoints)
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        files = 1 << 16 if files == resource.RLIM_INFINITY else files
        backlog = max(8, min(2048, files // 8))
        most = max(8, min(limits.max_connections, files // 2 - backlog))
        protocol = functools.partial(_bounded_h11(), head_timeout_s=limits.head_timeout_s, max_connections=most)
        config = uvicorn.Config(make_app(gateway, extra, limits), http=protocol, backlog=backlog, log_config=None,
                                log_level="warning",
                                access_log=False, lifespan="off", timeout_keep_alive=min(30, limits.head_timeout_s),
                                timeout_graceful_shutdown=2)  # a held call (a session whose rollout was given up)
        # must not hold the close
        self.uvicorn = uvicorn.Server(config)
        self.task = asyncio.run_coroutine_threadsafe(self.uvicorn.serve(sockets=[self.sock]), loop)
        deadline = time.time() + 30
        while not self.uvicorn.started and not self.task.done() and time.time() < deadline:
            time.sleep(0.01)
        if not self.uvicorn.started:
            error = self.task.exception() if self.task.done() else None
            raise RuntimeError(f"the gateway did not start on {host}:{self.port}: {error or 'timed out'}")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self, timeout: float = 5.0) -> None:
        self.uvicorn.should_exit = True
        try:
            self.task.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - shutting down: the loop may already be stopping
            pass
        self.sock.close()



@functools.cache
def _bounded_h11():
    """uvicorn's h11 protocol, bounded (a class made once, when the first server starts: uvicorn is imported then)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol, h11

    class BoundedH11(H11Protocol):
        """uvicorn's h11 protocol with a deadline for each request's head (uvicorn has none: a client sending a
        header byte a minute held its connection forever) and a cap on connections: at the cap a new connection
        drops the one that has waited longest for its client's bytes (a slow head or body), never one whose
        request is in whole."""

        def __init__(self, *args, head_timeout_s: float, max_connections: int, **kwargs):
            super().__init__(*args, **kwargs)
            self.head_timeout_s, self.max_connections = head_timeout_s, max_connections
            self.waiting_since: float | None = None  # waiting for the client's request since (loop time)
            self.head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_head()
            if len(self.connections) > self.max_connections:
                waiting = [c for c in self.connections if isinstance(c, BoundedH11) and c.waiting_since is not None]
                min(waiting, key=lambda c: c.waiting_since)._drop()

        def handle_events(self) -> None:
            super().handle_events()
            state = self.conn.their_state
            if state is not h11.IDLE and self.head_timer is not None:  # the head came in whole
                self.head_timer.cancel()
                self.head_timer = None
            if state is not h11.IDLE and state is not h11.SEND_BODY:  # and the body
                self.waiting_since = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._await_head()

        def connection_lost(self, exc) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            self.waiting_since = self.loop.time()
            self.head_timer = self.loop.call_later(self.head_timeout_s, self._drop)

        def _drop(self) -> None:
            self.waiting_since = self.head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedH11
