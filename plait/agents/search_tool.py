"""verl's retrieval tool (`class_name: verl.tools.search_tool.SearchTool`, the tool of verl's Search-R1
example, examples/sglang_multiturn/search_r1_like), which verl 0.9.1's wheel does not ship: the model
calls `search` with a list of queries, the tool POSTs them to a retrieval service (the API of
Search-R1's and verl's `retrieval_server.py`) and answers the passages in verl's layout:

    POST retrieval_service_url   {"queries": [q1, q2], "topk": k, "return_scores": true}
      <- {"result": [[{"document": {"contents": "Title\\ntext"}, "score": s}, ...],    (q1's passages)
                     [...]]}                                                         (q2's)
    the model reads  {"result": "Doc 1 (Title: Title)\\ntext\\n\\nDoc 2 (...)\\n---\\nDoc 1 (...)"}   (JSON text)

The tool entry's `config`: retrieval_service_url (required), topk (3), timeout (seconds per request,
30); plait's own: max_retries (10) and retry_delay (1 s), verl's fixed retry schedule made settable:
a refused connection, a timeout or a 500/502/503/504 answer is retried after retry_delay x attempt
seconds, any other HTTP error or a body that is not JSON is not. Whatever fails (the service is
down, slow, answers garbage) becomes the text the model reads, as verl words it, never an exception.
The step reward is 0.0; the metrics are verl's (query_count, status, total_results,
api_request_error).

Requests in flight: each tool worker process sends one at a time, so at most
`multi_turn.tool_num_workers`; with `enable_global_rate_limit` (true) at most `rate_limit` (120) of
them at once among the tool workers of one trainer process (verl: its Ray cluster), each request
holding one of `rate_limit` lock files while it runs. verl's `num_workers` (its Ray thread pool's
size) is machinery plait has no use for.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional
from uuid import uuid4

from plait.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from plait.reaper import caller_pid

RETRIED_STATUS = (500, 502, 503, 504)  # server errors verl retries; other HTTP errors end the call


@dataclass
class SearchConfig:
    """The tool entry's `config` (verl reads it with .get: unknown keys are ignored)."""
    retrieval_service_url: str = ""
    topk: int = 3
    timeout: float = 30               # seconds one request may take
    max_retries: int = 10             # plait's own: verl's fixed number of attempts
    retry_delay: float = 1.0          # plait's own: seconds before retry n are retry_delay * n (verl: 1)
    rate_limit: int = 120             # requests in flight at once, with enable_global_rate_limit
    enable_global_rate_limit: bool = True

    def __post_init__(self):
        if not self.retrieval_service_url:
            raise ValueError("SearchTool: config.retrieval_service_url is required (the retrieval service's "
                             "address, e.g. http://127.0.0.1:8000/retrieve)")
        if not isinstance(self.max_retries, int) or self.max_retries < 1:
            raise ValueError(f"SearchTool: config.max_retries={self.max_retries!r}: attempts per call, >= 1")
        if not isinstance(self.retry_delay, (int, float)) or self.retry_delay < 0:
            raise ValueError(f"SearchTool: config.retry_delay={self.retry_delay!r}: seconds >= 0")
        if not isinstance(self.rate_limit, int) or self.rate_limit < 1:
            raise ValueError(f"SearchTool: config.rate_limit={self.rate_limit!r}: requests in flight, >= 1")


class SearchTool(BaseTool):
    """verl's `search`: `{"query_list": [...]}` -> the retrieved passages as JSON text, step reward 0.0."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema]):
        super().__init__(config, tool_schema)
        keys = ("retrieval_service_url", "topk", "timeout", "max_retries", "retry_delay", "rate_limit",
                "enable_global_rate_limit")
        self.settings = SearchConfig(**{k: config[k] for k in keys if k in config})
        # the trainer process started the tool workers: its id names the slots they share
        self.slots = (RequestSlots(f"plait-search-{os.getuid()}-{caller_pid()}", self.settings.rate_limit)
                      if self.settings.enable_global_rate_limit else None)
        self._instances: dict[str, list[str]] = {}  # instance -> the texts it answered (verl's "reward" list)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "search", "description": "Search for passages relevant to each query.",
                         "parameters": {"type": "object", "required": ["query_list"], "properties": {
                             "query_list": {"type": "array", "description": "The queries to search for"}}}}})

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id if instance_id is not None else str(uuid4())
        self._instances[instance_id] = []
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            return ToolResponse(text=json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list "
                                                           "in parameters."})), 0.0, {}
        s = self.settings
        try:
            with self.slots or contextlib.nullcontext():
                text, meta = await asyncio.to_thread(search_batch, s.retrieval_service_url, queries, s.topk,
                                                     s.timeout, s.max_retries, s.retry_delay)
            self._instances[instance_id].append(text.strip())
        except Exception as err:  # noqa: BLE001 - verl answers the model with it
            failed = json.dumps({"result": f"Search execution failed: {err}"})
            return ToolResponse(text=failed), 0.0, {"error": str(err)}
        metrics = {k: meta[k] for k in ("query_count", "status", "total_results", "api_request_error")}
        return ToolResponse(text=text), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs) -> list[str]:
        """As verl's: the texts this instance answered (not a number; verl's loop never asks)."""
        return self._instances[instance_id]

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


class RequestSlots:
    """At most `n` holders at once among the processes of this machine that use the same `name`: each
    holder keeps one of n lock files locked (flock: the lock goes with the process if it dies)."""

    def __init__(self, name: str, n: int):
        self.paths = [os.path.join(tempfile.gettempdir(), f"{name}-slot{i}") for i in range(n)]
        self.fd: Optional[int] = None

    def __enter__(self):
        while True:
            for path in self.paths:
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.fd = fd
                return self
            time.sleep(0.01)  # every slot is held: wait for a request to end

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def call_retriever(url: str, queries: list, topk: int, timeout: float, max_retries: int = 10,
                   retry_delay: float = 1.0) -> tuple[Any, Optional[str]]:
    """(the service's JSON, None), or (None, the line saying why not) after verl's retries."""
    import requests  # here: only a run with the search tool needs it
    payload = {"queries": queries, "topk": topk, "return_scores": True}
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    error = None
    for attempt in range(1, max_retries + 1):
        try:
            reply = requests.post(url, headers=headers, json=payload, timeout=timeout)
            if reply.status_code not in RETRIED_STATUS:
                reply.raise_for_status()
                return reply.json(), None
            error = f"API Request Error: Server Error ({reply.status_code}) on attempt {attempt}/{max_retries}"
        except requests.exceptions.ConnectionError as err:  # before Timeout: a connect timeout is both, verl says this
            error = f"Connection Error: {err}"
        except requests.exceptions.Timeout as err:
            error = f"Timeout Error: {err}"
        except requests.exceptions.RequestException as err:  # a 4xx, or a body that is not JSON: not retried
            return None, f"API Call Failed: API Request Error: {err}"
        except Exception as err:  # noqa: BLE001 - verl words anything else this way
            return None, f"API Call Failed: Unexpected Error: {err}"
        if attempt < max_retries:
            time.sleep(retry_delay * attempt)
    return None, f"API Call Failed: {error}"


def search_batch(url: str, queries: list, topk: int, timeout: float, max_retries: int = 10,
                 retry_delay: float = 1.0) -> tuple[str, dict]:
    """One request for all queries: the JSON text the model reads, and verl's metadata of the call."""
    response, error = call_retriever(url, queries, topk, timeout, max_retries, retry_delay)
    meta = {"query_count": len(queries), "queries": queries, "api_request_error": error, "api_response": None,
            "status": "api_error", "total_results": 0, "formatted_result": None}
    if error:
        return _said(f"Search error: {error}"), meta
    if not response:  # null, {} or []: verl's "unknown state"
        meta["status"] = "unknown_api_state"
        return _said("Unknown API state (no response and no error message)."), meta
    meta["api_response"] = response
    try:
        per_query = response.get("result", [])
        if not per_query:
            meta["status"] = "no_results"
            return _said("No search results found."), meta
        text = "\n---\n".join(format_passages(passages) for passages in per_query)
        total = sum(len(p) if isinstance(p, list) else 1 for p in per_query)
    except Exception as err:  # noqa: BLE001 - a reply of another shape: the model reads why
        meta["status"] = "processing_error"
        return _said(f"Error processing search results: {err}"), meta
    meta.update(status="success", total_results=total, formatted_result=text)
    return _said(text), meta


def format_passages(passages: list) -> str:
    """One query's passages: "Doc i (Title: first line)" then the rest of the passage, a blank line apart."""
    blocks = []
    for i, passage in enumerate(passages, 1):
        title, _, body = passage["document"]["contents"].partition("\n")
        blocks.append(f"Doc {i} (Title: {title})\n{body}\n\n")
    return "".join(blocks).strip()


def _said(text: str) -> str:
    return json.dumps({"result": text}, ensure_ascii=False)
