"""The HTTP server: OpenAI's and Anthropic's endpoints over a Gateway, on an event loop of plait's.

    /v1/chat/completions   /v1/completions   /v1/models        OpenAI (base_url .../v1)
    /v1/responses                                              OpenAI's Responses API (plait/serving/responses.py)
    /v1/messages           /v1/messages/count_tokens           Anthropic (base_url ...)
    /generate                                                  SGLang's token-level generate (verl's reward router)
    /sessions/{id}/...     the same, inside a session (one row's rollout while plait trains)
    POST /sessions/{id}/reward  {"reward": float}               the agent's own reward for its row
    GET /health

A session is named by its path or by the API key (`Authorization: Bearer <id>`, `x-api-key: <id>`),
so an agent needs nothing but a base URL and a key. Starlette and uvicorn, the stack FastAPI itself
runs on, without FastAPI's request models: plait checks bodies itself (plait/serving/protocol.py) so
that a wrong request gets the API's own error shape and status, never a framework's or a traceback.
The server runs as a task on an existing asyncio loop (the rollout worker's agent-loop thread while
training, so a handler awaits the engine queue directly), bound to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plait.serving import protocol, responses
from plait.serving.gateway import Gateway
from plait.serving.protocol import SESSION_HEADER, ApiError

log = logging.getLogger("plait.serving")


def handled(api: str):
    """An endpoint's errors in its API's shape: ApiError as itself, anything else a 500 (logged, no traceback out)."""
    def wrap(method):
        async def endpoint(self, request: Request) -> Response:
            try:
                return await method(self, request)
            except ApiError as err:
                return JSONResponse(err.openai() if api == "openai" else err.anthropic(), status_code=err.status)
            except Exception as err:  # noqa: BLE001 - never a traceback to the client; the server log has it
                log.exception("plait gateway: %s %s failed", request.method, request.url.path)
                err = ApiError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error")
                return JSONResponse(err.openai() if api == "openai" else err.anthropic(), status_code=500)
        return endpoint
    return wrap


class Api:
    """The endpoints over one Gateway."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
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

    @staticmethod
    async def body_of(request: Request):
        try:
            return json.loads(await request.body())
        except ValueError as err:
            raise ApiError(400, f"the request body is not JSON: {err}") from None

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
        prompt_ids, req = protocol.completion_request(await self.body_of(request), encode)
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
        prompt_ids, req, logprob = protocol.generate_request(body, encode)
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


def make_app(gateway: Gateway, extra: list[Route] | None = None) -> Starlette:
    """The gateway's routes, and `extra` ones served beside them (the Tinker API's under /api/v1)."""
    api = Api(gateway)
    routes = [Route("/health", api.health, methods=["GET"]), Route("/sessions/{sid}/reward", api.reward, methods=["POST"])]
    for prefix in ("", "/sessions/{sid}"):
        routes += [Route(f"{prefix}/v1/chat/completions", api.chat, methods=["POST"]),
                   Route(f"{prefix}/generate", api.generate, methods=["POST"]),
                   Route(f"{prefix}/v1/completions", api.completions, methods=["POST"]),
                   Route(f"{prefix}/v1/responses", api.response, methods=["POST"]),
                   Route(f"{prefix}/v1/messages", api.messages, methods=["POST"]),
                   Route(f"{prefix}/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
                   Route(f"{prefix}/v1/models", api.models, methods=["GET"])]
    return Starlette(routes=routes + (extra or []))


def _sse(events: list[str]) -> StreamingResponse:
    async def stream():
        for event in events:
            yield event
    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class Server:
    """uvicorn serving `make_app(gateway)` as a task on `loop` (another thread's running loop)."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop, host: str = "127.0.0.1", port: int = 0,
                 extra: list[Route] | None = None):
        import uvicorn
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
        config = uvicorn.Config(make_app(gateway, extra), log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30, timeout_graceful_shutdown=2)  # a held call
        # (a session whose rollout was given up) must not hold the close
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

