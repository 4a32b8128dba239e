"""The Tinker API's HTTP endpoints (`/api/v1/...`, as the `tinker` SDK 0.38 calls them) over one TinkerTrainer.

    SDK ──POST /api/v1/forward_backward (protobuf) ──▶ checked here ──▶ job queue ──▶ worker thread (trainer.py)
        ◀─ {"request_id"} at once (a malformed request: 400 naming the field, before any work)
        ──POST /api/v1/retrieve_future ──▶ waits up to POLL_S for the job ──▶ its result, its error, or try_again

Training, saving, loading and sampling are futures run one at a time, in arrival order, on the worker thread
(the SDK sends a client's requests in its own order, so a client's steps apply in order). Sample requests for one
sampler with the same unseeded params are one engine call: the SDK sends a batch's prompts as concurrent requests
that arrive some ms apart, so a sample waits up to GATHER_S after the last of them for more (GATHER_MAX_S in all)
before it starts, unless the burst is already whole: every request its sampler has had is gathered and they are as
many as the largest first burst of the same client's (or session's) earlier samplers (an RL loop makes a sampler a
step and sends it the same number of prompts; a burst larger than that is two engine calls once, then expected).
Sessions, config and capabilities answer at once. Any `tml-` API key is accepted (the SDK requires the prefix; this
server is local). A job's failure comes back as the API's failed future (`{"error", "category"}`); a request refused at
once as HTTP 400/404/409 with `{"error", "category": "user", "field"}`; an endpoint plait does not serve as 404
naming it. The server keeps serving after either.

A future is named by what the SDK sent (its model or sampler and the request's seq_id), so a request retried after
a lost answer finds its first future and is applied once.

A restart (kill -9 included) keeps what the journal (ROOT/server.jsonl, a line per event, flushed before the
answer it records goes out) holds: the sessions, every finished future's answer (a retried request still gets it,
and is not run again), the training clients (each as of its last save_state or load_state, or as created when it
never had one) and the samplers made from a path or the base model. A client that had trained since that point
comes back "stale": its training requests are refused, naming the checkpoint, until a load_state; its unsaved
steps and gradients are gone. Lost: futures not finished at the kill (retrieving one answers 410, "send it
again"), samplers made from a client's weights in memory (save_weights_and_get_sampling_client), the timeline's
step count. The journal survives a killed process (it is in the OS's hands once flushed), not a crashed machine
(no fsync).

Every job is two spans on plait's timeline (profiler/timeline.py; written when the server has an output folder):
`queue` (from its arrival to its start) and its own (`forward_backward`, `forward`, `optim_step`, `sample`,
`save`, `load`, `create`, ...; inside a sample, `load_weights` when the engine takes that sampler's weights), role
`tinker`, "session" the model or sampler id it is for (which begins with its
session's id); a record's step is the number of optimizer steps the server had taken. `export_session_trace`
(GET sessions/{id}/trace_export) writes one session's spans as a Chrome trace (gzip JSON, which ui.perfetto.dev
opens) with a lane per client, and answers a URL under an unguessable name that a plain GET downloads.

Left out: server-side custom losses, the REST listing endpoints, compacting the journal (it grows with every
request; sessions that `close` are not restored).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import json
import logging
import queue
import os
import threading
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from plait.profiler.timeline import TIMELINE, read_timeline
from plait.serving.protocol import ApiError
from plait.serving.tinker.trainer import Lora, SampleParams, TinkerTrainer
from plait.serving.tinker.wire import decode_forward_backward

log = logging.getLogger("plait.serving.tinker")
POLL_S = 10.0        # how long a retrieve_future waits for its job before answering try_again
KEPT_RESULTS = 4096  # finished futures kept for a repeated retrieve
JOURNAL = "server.jsonl"  # in the Tinker dir: what a restart restores
GATHER_S = 0.006     # a sample waits this long for the next of its kind (the SDK sends a batch's prompts as
GATHER_MAX_S = 0.03  # concurrent requests, a few ms apart), at most this long in all: one engine call for them


def error(err: ApiError) -> JSONResponse:
    return JSONResponse({"error": err.message, "category": "user", "field": err.param}, status_code=err.status)


def endpoint(method):
    """An endpoint's refusals in the Tinker error shape; anything unexpected a 500 (logged, no traceback out)."""
    async def run(self, request: Request) -> Response:
        key = request.headers.get("x-api-key", "")
        if not key.startswith("tml-"):
            return error(ApiError(401, "X-API-Key must be a Tinker API key (any key starting with 'tml-' is "
                                       "accepted here)", param="X-API-Key"))
        try:
            return await method(self, request)
        except ApiError as err:
            return error(err)
        except Exception as err:  # noqa: BLE001 - never a traceback to the client; the server log has it
            log.exception("plait tinker: %s %s failed", request.method, request.url.path)
            return JSONResponse({"error": f"internal error: {type(err).__name__}: {err}", "category": "server"},
                                status_code=500)
    return run


async def parse(request: Request, model):
    """The JSON body as the SDK's request type `model` (its own pydantic model), or ApiError naming the first bad field."""
    import pydantic
    try:
        return model.model_validate(await request.json())
    except ValueError as err:  # not JSON (json's error is a ValueError)
        if not isinstance(err, pydantic.ValidationError):
            raise ApiError(400, f"the body is not JSON: {err}", param="body") from None
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None


def answer(result, failure: BaseException | None):
    """A job's outcome as retrieve_future answers it: its result (JSON-able or protobuf bytes), or the API's failure."""
    if failure is None:
        return result
    if isinstance(failure, ApiError):
        return {"error": failure.message, "category": "user"}
    return {"error": f"{type(failure).__name__}: {failure}", "category": "server"}


class Journal:
    """Append-only JSON lines, flushed per record (a killed process loses none); a torn last line is skipped."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path, self.lock = path, threading.Lock()
        self.file = open(path, "a", encoding="utf-8")

    def records(self) -> list[dict]:
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:  # the line a kill cut short (or an empty one)
                continue
        return out

    def add(self, record: dict) -> None:
        if isinstance(record.get("answer"), bytes):
            record = {**record, "answer": {"b64": base64.b64encode(record["answer"]).decode()}}
        with self.lock:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.file.close()


@dataclass
class Burst:
    """A sampler's sample requests so far, and whether its first engine call has ended."""
    asked: int = 0
    first_done: bool = False


def owner(sampler_id: str) -> str:
    """The training client or session a sampler is of (its id is OWNER:sample:N)."""
    return sampler_id.rsplit(":sample:", 1)[0]


def seq(owner: str, seq_id: int | None) -> str:
    """A request's future id: its model or sampler and its seq_id (a fresh id when it sent none)."""
    return f"{owner}:{seq_id}" if seq_id is not None else f"{owner}:{uuid.uuid4().hex}"


class TinkerApi:
    """The endpoints, the sessions and the futures over one trainer; jobs run on `self.worker`."""

    def __init__(self, trainer: TinkerTrainer, max_tokens: int):
        self.trainer, self.max_tokens = trainer, max_tokens
        self.sessions: set[str] = set()
        self.futures: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self.jobs: queue.Queue = queue.Queue()
        self.steps = 0  # optimizer steps taken on this server: the timeline's step
        self.traces: dict[str, str] = {}  # a session trace's download name -> its file
        self.stale: dict[str, str] = {}  # a client restored behind its last answers -> why it is refused
        self.bursts: dict[str, Burst] = {}  # per sampler; with `expected`, when a sample's gather ends (_samples_with)
        self.expected: dict[str, int] = {}  # per owner(sampler): the largest first burst of its samplers so far
        self.journal = Journal(os.path.join(trainer.root, JOURNAL))
        self.restored = self._restore()  # the sessions from before a restart
        self.worker = threading.Thread(target=self._work, name="plait-tinker-trainer", daemon=True)
        self.worker.start()

    def close(self) -> None:
        self.jobs.put(None)
        self.worker.join(timeout=30)
        self.trainer.close()
        self.journal.close()

    def _restore(self) -> set[str]:
        """Sessions, finished futures, clients and path samplers from the journal (module docstring); the sessions."""
        clients: dict[str, dict] = {}
        samplers: dict[str, str | None] = {}
        for rec in self.journal.records():
            who = rec.get("who")
            if "session" in rec:
                self.sessions.add(rec["session"])
            if "end" in rec:
                self.sessions.discard(rec["end"])
            if "client" in rec and rec.get("base") == self.trainer.name:
                clients[who] = {"lora": rec["client"], "state": None, "optimizer": False, "moved": False}
            if who in clients and "state" in rec:
                clients[who].update(state=rec["state"], optimizer=rec["optimizer"], moved=False)
            if who in clients and rec.get("moved"):
                clients[who]["moved"] = True
            if "sampler" in rec:
                samplers[rec["sampler"]] = rec["path"]
            if rec.get("future"):
                future: concurrent.futures.Future = concurrent.futures.Future()
                done = rec["answer"]
                future.set_result(base64.b64decode(done["b64"]) if isinstance(done, dict) and "b64" in done else done)
                self.futures[rec["future"]] = future
        while len(self.futures) > KEPT_RESULTS:
            self.futures.popitem(last=False)
        live = lambda who: who.split(":")[0] in self.sessions  # noqa: E731 - a closed session's clients stay gone
        for model_id, c in clients.items():
            if not live(model_id):
                continue
            try:
                if c["state"] is None:
                    self.trainer.create(model_id, Lora(**c["lora"]))
                else:
                    self.trainer.create_from(model_id, c["state"], c["optimizer"])
            except Exception as err:  # noqa: BLE001 - a checkpoint deleted since: that client is not restored
                log.warning("plait tinker: client %s not restored: %s", model_id, err)
                continue
            if c["moved"]:
                self.stale[model_id] = (
                    f"model_id {model_id!r}: the server restarted after it trained past its last checkpoint; it is "
                    + (f"{c['state']} again: load_state({c['state']!r}) to go on from there" if c["state"] else
                       "as created (it never saved): create a new training client") + " (unsaved steps are lost)")
        for sampler_id, path in samplers.items():
            if live(sampler_id):
                try:
                    self.trainer.sampler_from_path(sampler_id, path)
                except Exception as err:  # noqa: BLE001 - as above
                    log.warning("plait tinker: sampler %s not restored: %s", sampler_id, err)
        return set(self.sessions)

    def _record(self, request_id: str | None, who: str, fn, args, result, failure) -> None:
        """The job's journal line, if it has an answer to keep or changes what a restart restores."""
        rec: dict = {"who": who}
        if request_id is not None:
            rec.update(future=request_id, answer=answer(result, failure))
        name = fn.__name__
        if failure is None:
            if name in ("create", "create_from"):
                rec.update(client=vars(self.trainer.clients[args[0]].lora), base=self.trainer.name)
            if name in ("create_from", "load"):
                rec.update(state=args[1], optimizer=args[2])
            if name == "save" and args[2] == "weights":
                rec.update(state=result["path"], optimizer=True)
            if name == "optim_step" or (name == "forward_backward" and not args[0].forward_only):
                rec["moved"] = True
            if name == "sampler_from_path":
                rec.update(sampler=args[0], path=args[1])
            if "state" in rec:
                self.stale.pop(who, None)
        if len(rec) > 1:
            self.journal.add(rec)

    def _work(self) -> None:
        ahead = None  # a job taken while gathering samples, run next
        while (job := ahead or self.jobs.get()) is not None:
            batch, ahead = self._samples_with(job)
            start = time.perf_counter()
            results, failure = [None] * len(batch), None
            try:
                if len(batch) > 1:
                    sampler, _, _, params, _ = job[2]
                    results = self.trainer.sample_many(sampler, params, [(a[1], a[2], a[4]) for _, _, a, *_ in batch])
                else:
                    results = [job[1](*job[2])]
            except ApiError as err:
                failure = err
            except Exception as err:  # noqa: BLE001 - a failed future, the server goes on
                log.exception("plait tinker: %s failed", job[1].__name__)
                failure = err
            end = time.perf_counter()
            if job[1] == self.trainer.sample:
                self._burst_ended(job[2][0])
            for (future, fn, args, who, queued, request_id), result in zip(batch, results):
                stage = "forward" if fn.__name__ == "forward_backward" and args[0].forward_only else fn.__name__
                self.steps += stage == "optim_step"
                TIMELINE.add("tinker", "queue", queued, start, None, who)
                TIMELINE.add("tinker", stage, start, end, None, who)
                TIMELINE.flush(self.steps)  # before the answer: whoever holds it finds the job on the timeline
                self._record(request_id, who, fn, args, result, failure)  # before the answer: a restart keeps it
                if failure is None:
                    future.set_result(result)
                else:
                    future.set_exception(failure)

    def _samples_with(self, job) -> tuple[list, object]:
        """`job`, and when it samples, the sample jobs queued right behind it for the same sampler with the same
        unseeded params (one engine call: trainer.sample_many); the first other job taken is returned to run next."""
        batch = [job]
        if job[1] != self.trainer.sample or job[2][3].seed is not None:
            return batch, None
        until = time.perf_counter() + GATHER_MAX_S
        burst, expected = self.bursts.get(job[2][0], Burst()), self.expected.get(owner(job[2][0]), 0)
        while True:
            if burst.asked == len(batch) >= expected > 0:  # the sampler's first burst is whole: no more will come
                return batch, None
            try:
                more = self.jobs.get(timeout=max(0.0, min(GATHER_S, until - time.perf_counter())))
            except queue.Empty:
                return batch, None
            if more is None or more[1] != self.trainer.sample or more[2][0] != job[2][0] or more[2][3] != job[2][3]:
                if more is None:
                    self.jobs.put(None)  # the end: after what is taken
                return batch, more
            batch.append(more)

    def _asked(self, sampler_id: str) -> None:
        """One more sample request for `sampler_id` (on the event loop, before it is queued)."""
        self.bursts.setdefault(sampler_id, Burst()).asked += 1

    def _burst_ended(self, sampler_id: str) -> None:
        """A sample engine call of `sampler_id` ended: at the first, its requests so far are its first burst."""
        burst = self.bursts.get(sampler_id)
        if burst is not None and not burst.first_done:
            burst.first_done = True
            self.expected[owner(sampler_id)] = max(self.expected.get(owner(sampler_id), 0), burst.asked)

    def submit(self, request_id: str, fn, *args, **extra) -> JSONResponse:
        """Queue `fn(*args)` as the future `request_id`, named by what the SDK sent (its model or sampler and seq_id):
        a retried request finds its first future and is applied once."""
        if request_id in self.futures:
            return JSONResponse({"request_id": request_id, **extra})
        who = request_id.rsplit(":", 1)[0]
        if who in self.stale and fn != self.trainer.load:
            raise ApiError(400, self.stale[who], param="model_id")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.futures[request_id] = future
        while len(self.futures) > KEPT_RESULTS:
            self.futures.popitem(last=False)
        self.jobs.put((future, fn, args, who, time.perf_counter(), request_id))
        return JSONResponse({"request_id": request_id, **extra})

    async def run(self, who: str, fn, *args):
        """A job for `who` run on the worker (in order with the futures) and awaited here: for the calls the SDK does
        not poll."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((future, fn, args, who, time.perf_counter(), None))
        return await asyncio.wrap_future(future)

    # -- checks at the door ----------------------------------------------------------------------------------------
    def client(self, model_id: str | None) -> str:
        if model_id not in self.trainer.clients:
            raise ApiError(404, f"model_id {model_id!r} is not a training client on this server", param="model_id")
        return model_id

    def base(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.trainer.name:
            raise ApiError(400, f"base_model {base_model!r} is not served here; this server serves "
                                f"{self.trainer.name!r}", param="base_model")

    def tokens(self, tokens: list[int], field: str, then: int = 0) -> None:
        """Token ids in the vocabulary, and `then` more tokens (a sample's budget) within the model's context."""
        context = self.trainer.context
        if context is not None and len(tokens) + then > context:
            raise ApiError(400, f"{field} has {len(tokens)} tokens{f' and {then} to sample' if then else ''}: over the "
                                f"model's context of {context}", param=field)
        bad = [t for t in tokens if not 0 <= t < self.trainer.vocab]
        if bad:
            raise ApiError(400, f"{field} has token ids outside the vocabulary [0, {self.trainer.vocab}): {bad[:5]}",
                           param=field)

    # -- sessions, config ------------------------------------------------------------------------------------------
    @endpoint
    async def client_config(self, request: Request) -> Response:
        # API keys only (no JWT exchange); plain httpx (the SDK's pyqwest transport, Tinker's default, took 7-10 ms less
        # of a GRPO step: off until it has a CI run of its own, docs/tinker.md); one forward_backward chunk at a time
        return JSONResponse({"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False})

    @endpoint
    async def dynamic_config(self, request: Request) -> Response:
        return JSONResponse({"refresh_interval_sec": 300})

    @endpoint
    async def create_session(self, request: Request) -> Response:
        session_id = f"plait-{uuid.uuid4().hex[:12]}"
        self.sessions.add(session_id)
        self.journal.add({"session": session_id})
        return JSONResponse({"type": "create_session", "session_id": session_id})

    @endpoint
    async def heartbeat(self, request: Request) -> Response:
        return JSONResponse({"type": "session_heartbeat"})

    @endpoint
    async def finish(self, request: Request) -> Response:
        self.sessions.discard(request.path_params["sid"])
        self.journal.add({"end": request.path_params["sid"]})
        return JSONResponse({})

    @endpoint
    async def telemetry(self, request: Request) -> Response:
        return JSONResponse({"status": "accepted"})  # the SDK's own telemetry: not kept

    @endpoint
    async def capabilities(self, request: Request) -> Response:
        return JSONResponse({"supported_models": [{"model_name": self.trainer.name, "trainable": True, "sampleable": True,
                                                   "max_context_length": self.trainer.context}]})

    @endpoint
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @endpoint
    async def cancel(self, request: Request) -> Response:
        return JSONResponse({})  # a sample runs to its end; its result is simply never retrieved

    # -- training --------------------------------------------------------------------------------------------------
    @endpoint
    async def create_model(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.CreateModelRequest)
        self.base(req.base_model)
        if req.session_id not in self.sessions:
            raise ApiError(404, f"session_id {req.session_id!r} is not a session of this server", param="session_id")
        if req.lora_config is None or req.lora_config.rank < 0:
            raise ApiError(400, "lora_config.rank must be a positive integer (a LoRA adapter) or 0 (full fine-tuning)",
                           param="lora_config.rank")
        if req.lora_config.rank == 0:
            skipped = [k for k in ("train_mlp", "train_attn", "train_unembed") if not getattr(req.lora_config, k)]
            if skipped:
                raise ApiError(400, f"lora_config.{skipped[0]} is False with rank 0: full fine-tuning trains every "
                                    "weight", param=f"lora_config.{skipped[0]}")
        if req.optimizer_config.type != "adamw":
            raise ApiError(400, f"optimizer_config.type {req.optimizer_config.type!r} is not served; adamw only",
                           param="optimizer_config.type")
        lora = Lora(**req.lora_config.model_dump(include={"rank", "seed", "train_mlp", "train_attn", "train_unembed"}))
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        return self.submit(f"{model_id}:create", self.trainer.create, model_id, lora, model_id=model_id)

    @endpoint
    async def get_info(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.GetInfoRequest)
        return JSONResponse(self.trainer.info(self.client(req.model_id)))

    @endpoint
    async def forward_backward(self, request: Request) -> Response:
        if "protobuf" not in request.headers.get("content-type", ""):
            raise ApiError(400, "forward_backward takes the SDK's protobuf body (Content-Type: application/x-protobuf)",
                           param="Content-Type")
        req = decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
        self.client(req.model_id)
        for i, datum in enumerate(req.data):
            self.tokens(datum.tokens, f"data[{i}].model_input")
            self.tokens(datum.inputs["target_tokens"].tolist(), f"data[{i}].loss_fn_inputs.target_tokens")
        return self.submit(f"{req.model_id}:{req.seq_id}", self.trainer.forward_backward, req, model_id=req.model_id)

    @endpoint
    async def optim_step(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.OptimStepRequest)
        self.client(req.model_id)
        if not isinstance(req.optim_params, types.AdamParams):
            raise ApiError(400, f"optim_params of type {req.optim_params.type!r} are not served; AdamParams only",
                           param="optim_params")
        return self.submit(seq(req.model_id, req.seq_id), self.trainer.optim_step, req.model_id, req.optim_params,
                           model_id=req.model_id)

    @endpoint
    async def save_weights(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.SaveWeightsRequest)
        self.client(req.model_id)
        name = self._name(req.path)
        return self.submit(seq(req.model_id, req.seq_id), self.trainer.save, req.model_id, name, "weights", req.overwrite,
                           model_id=req.model_id)

    @endpoint
    async def load_weights(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.LoadWeightsRequest)
        self.trainer.folder(req.path)  # a malformed path is refused now
        if req.model_id is not None:
            self.client(req.model_id)
            return self.submit(seq(req.model_id, req.seq_id), self.trainer.load, req.model_id, req.path, req.optimizer,
                               model_id=req.model_id)
        if req.session_id not in self.sessions or req.model_seq_id is None:
            raise ApiError(404, f"session_id {req.session_id!r} is not a session of this server", param="session_id")
        self.base(req.base_model)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        return self.submit(f"{model_id}:create", self.trainer.create_from, model_id, req.path, req.optimizer,
                           model_id=model_id)

    @endpoint
    async def save_for_sampler(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.SaveWeightsForSamplerRequest)
        self.client(req.model_id)
        if req.path is not None:
            name = self._name(req.path)
            return self.submit(seq(req.model_id, req.seq_id), self.trainer.save, req.model_id, name, "sampler_weights",
                               True, model_id=req.model_id)
        if req.kind != "snapshot":
            raise ApiError(400, f"kind {req.kind!r} is not served; snapshot only", param="kind")
        sampler_id = f"{req.model_id}:sample:{req.sampling_session_seq_id}"
        return self.submit(seq(req.model_id, req.seq_id), self.trainer.sampler_from_client, sampler_id, req.model_id,
                           model_id=req.model_id)

    @staticmethod
    def _name(path: str | None) -> str:
        if not path or "/" in path or path in (".", ".."):
            raise ApiError(400, f"path {path!r} must be a checkpoint name (no '/')", param="path")
        return path

    # -- sampling --------------------------------------------------------------------------------------------------
    @endpoint
    async def create_sampling_session(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.CreateSamplingSessionRequest)
        if req.model_path is None:
            self.base(req.base_model or self.trainer.name)
        else:
            self.trainer.folder(req.model_path, "model_path")
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        await self.run(sampler_id, self.trainer.sampler_from_path, sampler_id, req.model_path)
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    @endpoint
    async def get_sampler(self, request: Request) -> Response:
        sampler_id = request.path_params["sid"]
        if sampler_id not in self.trainer.samplers:
            raise ApiError(404, f"sampler {sampler_id!r} is not a sampling session of this server", param="sampler_id")
        return JSONResponse({"sampler_id": sampler_id, "base_model": self.trainer.name,
                             "model_path": self.trainer.samplers[sampler_id].model_path})

    @endpoint
    async def asample(self, request: Request) -> Response:
        from tinker import types
        req = await parse(request, types.SampleRequest)
        if req.sampling_session_id not in self.trainer.samplers:
            raise ApiError(404, f"sampling_session_id {req.sampling_session_id!r} is not a sampling session of this "
                                "server (sampling by model_path or base_model without a session is not served)",
                           param="sampling_session_id")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if getattr(req, name):
                raise ApiError(400, f"{name} is not served (0 only)", param=name)
        if req.target_prompt_logprobs is not None or req.prompt_logprobs_last_n is not None or req.record_stability_info:
            field = next(f for f in ("target_prompt_logprobs", "prompt_logprobs_last_n", "record_stability_info")
                         if getattr(req, f))
            raise ApiError(400, f"{field} is not served", param=field)
        try:
            prompt = req.prompt.to_ints()
        except ValueError as err:
            raise ApiError(400, f"prompt: {err}", param="prompt") from None
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        if req.num_samples < 1:
            raise ApiError(400, f"num_samples must be at least 1, got {req.num_samples}", param="num_samples")
        params = self._sample_params(req.sampling_params)
        self.tokens(prompt, "prompt", then=params.max_tokens)
        sequence_ids = [f"{req.sampling_session_id}:{req.seq_id}:{i}" for i in range(req.num_samples)]
        if seq(req.sampling_session_id, req.seq_id) not in self.futures:  # not a retry
            self._asked(req.sampling_session_id)
        return self.submit(seq(req.sampling_session_id, req.seq_id), self.trainer.sample, req.sampling_session_id, prompt,
                           req.num_samples, params, bool(req.prompt_logprobs), sample_sequence_ids=sequence_ids)

    def _sample_params(self, sp) -> SampleParams:
        if sp.max_tokens is not None and sp.max_tokens < 1:
            raise ApiError(400, f"sampling_params.max_tokens must be at least 1, got {sp.max_tokens}",
                           param="sampling_params.max_tokens")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1:
            field = "temperature" if sp.temperature < 0 else "top_p"
            raise ApiError(400, f"sampling_params.{field} is out of range ({getattr(sp, field)})",
                           param=f"sampling_params.{field}")
        stop = sp.stop if isinstance(sp.stop, (list, tuple)) else [sp.stop] if sp.stop is not None else None
        ids = {t for t in stop if isinstance(t, int)} if stop is not None else set(self.trainer.eos_ids)
        strings = [s for s in stop or [] if isinstance(s, str)]
        return SampleParams(sp.max_tokens or self.max_tokens, sp.temperature, sp.top_k, sp.top_p, sp.seed, ids, strings)

    # -- futures ---------------------------------------------------------------------------------------------------
    @endpoint
    async def retrieve_future(self, request: Request) -> Response:
        from tinker import types
        request_id = (await parse(request, types.FutureRetrieveRequest)).request_id
        future = self.futures.get(request_id)
        if future is None and request_id.split(":")[0] in self.restored:
            raise ApiError(410, f"request_id {request_id!r} had not finished when the server restarted: send the "
                                "request again", param="request_id")
        if future is None:
            raise ApiError(404, f"request_id {request_id!r} is not a future of this server", param="request_id")
        if not future.done():
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), POLL_S)
            except asyncio.TimeoutError:
                return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
            except Exception:  # noqa: BLE001 - the job's failure, read from the future below
                pass
        result = answer(None, future.exception()) if future.exception() is not None else future.result()
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return JSONResponse(result)

    # -- session traces --------------------------------------------------------------------------------------------
    @endpoint
    async def trace_export(self, request: Request) -> Response:
        """The session's spans as a Chrome trace; its download URL (the SDK's export_session_trace polls this)."""
        session = request.path_params["sid"]
        try:
            path = await asyncio.to_thread(self._write_trace, session)
        except ValueError as err:
            return JSONResponse({"status": "failed", "error": str(err)})
        name = f"{uuid.uuid4().hex}.json.gz"
        self.traces[name] = path
        return JSONResponse({"status": "ready", "url": f"{str(request.base_url).rstrip('/')}/api/v1/traces/{name}"})

    def _write_trace(self, session: str) -> str:
        from plait.profiler.analysis.traces import Clock, MergedTrace, origin_of
        timeline = TIMELINE.path
        if timeline is None:
            raise ValueError("this server keeps no timeline (plait serve --output-dir DIR keeps one)")
        TIMELINE.flush(self.steps)
        spans = [{**s, "thread": s["session"]} for s in read_timeline(timeline)
                 if str(s.get("session", "")).startswith(f"{session}:")]  # a lane per client of the session
        if not spans:
            raise ValueError(f"session {session!r} has no requests on this server's timeline ({timeline})")
        path = os.path.join(os.path.dirname(timeline), "traces", f"{session}.json.gz")
        trace = MergedTrace(path, Clock(origin_of(spans, [])))
        trace.spans(spans, {spans[0]["pid"]: f"plait serve: Tinker session {session}"})
        trace.close()
        return path

    async def trace_file(self, request: Request) -> Response:
        """A written session trace by its unguessable name: no API key (the SDK downloads it with a plain GET)."""
        from starlette.responses import FileResponse
        path = self.traces.get(request.path_params["name"])
        if path is None:
            return error(ApiError(404, "no such trace (export it again: GET sessions/{id}/trace_export)", param="path"))
        return FileResponse(path, media_type="application/gzip", filename=os.path.basename(path))

    async def unserved(self, request: Request) -> Response:
        return error(ApiError(404, f"{request.method} {request.url.path} is not served by plait's local Tinker "
                                   "(docs/tinker.md lists what is)", param="path"))


def tinker_routes(api: TinkerApi) -> list[Route]:
    post = [("client/config", api.client_config), ("client/dynamic_config", api.dynamic_config),
            ("create_session", api.create_session), ("session_heartbeat", api.heartbeat),
            ("sessions/{sid}/finish", api.finish), ("telemetry", api.telemetry), ("cancel_future", api.cancel),
            ("create_model", api.create_model), ("get_info", api.get_info), ("forward_backward", api.forward_backward),
            ("optim_step", api.optim_step), ("save_weights", api.save_weights), ("load_weights", api.load_weights),
            ("save_weights_for_sampler", api.save_for_sampler), ("create_sampling_session", api.create_sampling_session),
            ("asample", api.asample), ("retrieve_future", api.retrieve_future)]
    get = [("get_server_capabilities", api.capabilities), ("healthz", api.healthz), ("samplers/{sid}", api.get_sampler),
           ("sessions/{sid}/trace_export", api.trace_export), ("traces/{name}", api.trace_file)]
    return ([Route(f"/api/v1/{path}", fn, methods=["POST"]) for path, fn in post]
            + [Route(f"/api/v1/{path}", fn, methods=["GET"]) for path, fn in get]
            + [Route("/api/v1/{rest:path}", api.unserved, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])])
