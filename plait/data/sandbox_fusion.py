"""verl 0.9.1's code reward: a response's Python code run on a SandboxFusion service, test case by test case.

verl scores the data sources in CODE_SOURCES this way when `reward.sandbox_fusion.url` is set:
    score = (test cases passed among the first 10) / min(#cases, 10)
Each case is one POST of the code to the service's /run_code endpoint (JSON in, JSON out); a case passes
when the run finishes and its stdout equals the expected output up to trailing newlines. Call-based cases
(`fn_name` in the test cases) run the code inside a small harness that reads the function's arguments as
JSON lines from stdin and prints its result. A service that is down, answers 5xx, times out or returns
something that is not JSON fails its case (score 0 for it, as in verl), with a warning at most once a
minute: the run goes on. Requests to the service are capped at `max_concurrent` at once across the process;
a batch's responses are scored side by side (`in_threads`: max_concurrent / 10 responses at once, each
sending its cases together), so the requests of several responses are in flight while one waits.

Left out: verl's local fallback without a url (prime_code: the driver refuses such rows at start), other
languages than Python (verl's default scorer sends only Python), and the cases after the first 10 (verl
runs them too but they never count: a compile error only marks the cases after it, so the score is the same).
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

log = logging.getLogger(__name__)

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
CASE_TIMEOUT_S = 10          # compile and run limit of each case, as verl's default scorer gives it
API_SLACK_S = 10             # a request may take compile + run limit + this before it is given up
RETRIES = 3                  # tries when the service answers 504 (gateway timeout), waiting 1 s, 2 s between
CASES_COUNTED = 10           # verl's continuous score counts the first 10 cases
# Names every call-based harness imports before the user's code, in verl's order: the code may use
# sqrt, Counter, List, ... without importing them, and scores the same as under verl only if it can here.
STAR_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")


def extract_code(completion: str) -> Optional[str]:
    """The code of a response as verl takes it: after the last ```python fence, else inside the first
    ``` fence (a language word on its first line dropped); None when there is no fence."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    code = completion.split("```")[1]
    if "\n" in code:
        first, rest = code.split("\n", 1)
        if first.strip().isalpha():
            code = rest
    return code


def read_cases(test_cases: Any) -> Optional[dict]:
    """The test cases as a dict with inputs and outputs (assert-only cases get empty inputs and no
    expected outputs); None when they are malformed (verl scores that 0)."""
    if isinstance(test_cases, (str, bytes)):
        try:
            test_cases = json.loads(test_cases)
        except json.JSONDecodeError:
            return None
    if not isinstance(test_cases, dict):
        return None
    if isinstance(test_cases.get("assert_case"), list):
        n = len(test_cases["assert_case"])
        return {"inputs": [""] * n, "outputs": [None] * n, **test_cases}
    return test_cases if test_cases.get("inputs") is not None and "outputs" in test_cases else None


def call_harness(code: str, fn_name: str) -> str:
    """`code` wrapped to call `fn_name` (a global function, else a method of `Solution()`) with the JSON
    values of stdin's lines as arguments and print the result (JSON for containers, None and bools). An
    error prints nothing to stdout and still exits 0, as verl's harness does."""
    prelude = "\n".join(["import traceback", *(f"from {m} import *" for m in STAR_MODULES),
                         *(f"import {m}" for m in STAR_MODULES[:-2])])
    return f"""{prelude}

{code}

def _plait_call():
    raw = sys.stdin.read()
    try:
        args = [json.loads(line) for line in raw.split("\\n")] if raw.strip() else []
        if {fn_name!r} in globals():
            target = globals()[{fn_name!r}]
        elif "Solution" in globals():
            target = getattr(globals()["Solution"](), {fn_name!r})
        else:
            target = None
        if not target:
            sys.stderr.write("no function {fn_name}\\n")
            return
        result = target(*args)
    except Exception:
        sys.stderr.write(traceback.format_exc())
        return
    print(json.dumps(result) if isinstance(result, (dict, list, tuple, bool)) or result is None else str(result))

if __name__ == "__main__":
    _plait_call()
"""


def post_run_code(url: str, payload: dict, timeout: float) -> tuple[Optional[Any], Optional[str]]:
    """The service's JSON answer to one /run_code request, or (None, why) after 3 tries on 504 or at the
    first other failure (connection refused, another HTTP error, no whole answer within `timeout`
    seconds, an answer that is not JSON or is over MAX_ANSWER_BYTES)."""
    body = json.dumps(payload).encode()
    why = None
    for attempt in range(RETRIES):
        try:
            status, reason, data = post_within(url, body, timeout)
        except (OSError, ValueError, http.client.HTTPException) as err:  # refused, reset, the deadline, a bad URL
            why = f"{type(err).__name__}: {err}"
            break
        if status == 504:
            why = f"HTTP {status} {reason}"
            if attempt < RETRIES - 1:
                time.sleep(attempt + 1)
            continue
        if not 200 <= status < 300:
            why = f"HTTP {status} {reason}"
            break
        try:
            return json.loads(data), None
        except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
            why = f"the answer is not JSON ({err})"
            break
    return None, why


MAX_ANSWER_BYTES = 16 << 20  # a /run_code answer (the program's stdout and stderr): more is not an answer


def post_within(url: str, body: bytes, deadline_s: float) -> tuple[int, str, bytes]:
    """POST `body` as JSON and read the whole answer within `deadline_s` seconds, connection, headers and
    body together: a socket time-out alone bounds each read, so a service that sends a byte every few
    seconds would hold the caller forever. At the deadline the socket is shut down from a timer thread,
    which ends any read under way; the answer is (status, reason, body) or TimeoutError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=deadline_s)
    late = threading.Event()

    def give_up():
        late.set()
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    timer = threading.Timer(deadline_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        conn.request("POST", parts.path or "/", body, {"Content-Type": "application/json",
                                                         "Accept": "application/json"})
        answer = conn.getresponse()
        data = answer.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            raise ValueError(f"the answer is over {MAX_ANSWER_BYTES >> 20} MiB")
        if late.is_set():
            raise TimeoutError
        return answer.status, answer.reason, data
    except (OSError, http.client.HTTPException):
        if late.is_set():
            raise TimeoutError(f"no whole answer within {deadline_s:g} s") from None
        raise
    finally:
        timer.cancel()
        conn.close()


def case_status(answer: Any, expected: Any) -> str:
    """What one case's /run_code answer means: success, wrong_answer, compile_error, timeout,
    runtime_error or an error of the service (only success passes)."""
    if not answer or not isinstance(answer, dict):
        return "bad_answer"
    compiled, ran = answer.get("compile_result") or {}, answer.get("run_result") or {}
    if not isinstance(compiled, dict) or not isinstance(ran, dict):
        return "bad_answer"
    status, run = answer.get("status"), ran.get("status")
    if status == "Success":
        if not ran or run != "Finished":
            return "unexpected_success_state"
        stdout = "" if ran.get("stdout") is None else ran["stdout"]
        passed = expected is None or str(stdout).rstrip("\n") == str(expected).rstrip("\n")
        return "success" if passed else "wrong_answer"
    if status != "Failed":
        return "sandbox_error"
    if compiled and (compiled.get("status") in ("Error", "TimeLimitExceeded")
                     or (compiled.get("status") == "Finished" and compiled.get("return_code") != 0)):
        return "compile_error"
    if run == "TimeLimitExceeded":
        return "timeout"
    if ran and (run == "Error" or (run == "Finished" and ran.get("return_code") != 0)):
        return "runtime_error"
    return "unknown_failure"


def run_case(url: str, code: str, stdin: Any, expected: Any, fn_name: Optional[str], timeout: float,
             memory_limit_mb: int, gate: threading.Semaphore) -> tuple[str, Optional[str]]:
    """One case on the service: (status, why the service gave no answer or None)."""
    payload = {"compile_timeout": timeout, "run_timeout": timeout,
               "code": call_harness(code, fn_name) if fn_name else code,
               "stdin": None if stdin is None else str(stdin), "memory_limit_MB": memory_limit_mb,
               "language": "python", "files": {}, "fetch_files": []}
    with gate:
        answer, why = post_run_code(url, payload, 2 * timeout + API_SLACK_S)
    return ("api_error", why) if why else (case_status(answer, expected), None)


def check_cases(url: str, code: str, cases: dict, memory_limit_mb: int, gate: threading.Semaphore,
                timeout: float = CASE_TIMEOUT_S) -> list[tuple[str, Optional[str]]]:
    """(status, service error) of each of the first CASES_COUNTED cases, run concurrently. Inputs and
    outputs of different lengths fail every case; a compile error fails the cases after it too."""
    inputs, outputs = list(cases["inputs"]), list(cases["outputs"])  # lists: parquet rows give arrays
    asserts = list(cases.get("assert_case", [""] * len(inputs)))
    if len(outputs) != len(inputs) or len(asserts) != len(inputs):
        return [("count_mismatch", None)] * len(inputs)
    n = min(len(inputs), CASES_COUNTED)
    with ThreadPoolExecutor(max_workers=max(n, 1)) as pool:
        futures = [pool.submit(run_case, url, f"{code}\n\n{asserts[i]}", inputs[i], outputs[i], cases.get("fn_name"),
                               timeout, memory_limit_mb, gate) for i in range(n)]
        results = [f.result() for f in futures]
    first = next((i for i, (status, _) in enumerate(results) if status == "compile_error"), n)
    return results[:first + 1] + [("compile_error_skipped", None)] * (n - first - 1)


def compute_score(url: str, completion: str, test_cases: Any, memory_limit_mb: int = 1024,
                  gate: Optional[threading.Semaphore] = None,
                  timeout: float = CASE_TIMEOUT_S) -> tuple[float, list[str]]:
    """verl's continuous code score of `completion` against `test_cases` (a JSON string or dict of
    inputs, outputs and optionally fn_name / assert_case), and each counted case's status."""
    code = extract_code(completion)
    cases = None if code is None else read_cases(test_cases)
    if cases is None:
        return 0.0, ["no_code_block" if code is None else "bad_test_cases"]
    try:
        results = check_cases(url, code, cases, memory_limit_mb, gate or threading.Semaphore(CASES_COUNTED), timeout)
    except Exception as err:  # noqa: BLE001 - verl scores any failure of its checker 0; the run goes on
        warn_unanswered(url, f"{type(err).__name__}: {err}")
        return 0.0, ["internal_error"]
    errors = [why for _, why in results if why]
    if errors:
        warn_unanswered(url, errors[-1], len(errors))
    statuses = [status for status, _ in results]
    return (statuses.count("success") / len(statuses) if statuses else 0.0), statuses


_warned = {"at": -math.inf, "unanswered": 0}
_lock = threading.Lock()


def warn_unanswered(url: str, why: str, count: int = 1) -> None:
    """One warning line at most once a minute while the service fails to answer, with the count since."""
    with _lock:
        _warned["unanswered"] += count
        if time.monotonic() - _warned["at"] < 60:
            return
        count, _warned["unanswered"], _warned["at"] = _warned["unanswered"], 0, time.monotonic()
    log.warning("reward.sandbox_fusion.url=%s: %d test case(s) got no answer (last: %s); they score 0, as in verl",
                url, count, why)


_gates: dict[int, threading.Semaphore] = {}
_response_gates: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]]" = \
    weakref.WeakKeyDictionary()


def shared_gate(max_concurrent: int) -> threading.Semaphore:
    """The process's semaphore of `max_concurrent` requests in flight (made on first use, so that the
    reward function, which holds only the number, stays a plain picklable value)."""
    with _lock:
        return _gates.setdefault(max_concurrent, threading.Semaphore(max_concurrent))


async def in_threads(fn, max_concurrent: int, **kwargs):
    """`fn(**kwargs)` in the running event loop's default executor, ceil(max_concurrent / 10) calls at once:
    wrapped with functools.partial, it makes a reward function `async`, so the naive manager scores a batch's
    responses side by side. asyncio.run joins the executor's threads when the batch ends: none outlive it."""
    loop = asyncio.get_running_loop()
    with _lock:
        gates = _response_gates.setdefault(loop, {})
        gate = gates.setdefault(max_concurrent, asyncio.Semaphore(-(-max_concurrent // CASES_COUNTED)))
    async with gate:
        return await loop.run_in_executor(None, functools.partial(fn, **kwargs))


def sandbox_score(solution_str: str, ground_truth: Any, url: str, max_concurrent: int = 64,
                  memory_limit_mb: int = 1024) -> float:
    """The score default_compute_score gives a code data source with `reward.sandbox_fusion.*` set."""
    return compute_score(url, solution_str, ground_truth, memory_limit_mb, shared_gate(max_concurrent))[0]
