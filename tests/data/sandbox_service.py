"""A local stand-in for a SandboxFusion service, for the code-reward tests: POST /run_code runs the
request's Python code in a subprocess with its stdin, run time limit (capped at `max_run_s`, as a
service configured with a lower limit does) and memory limit, and answers in SandboxFusion's JSON
shape. Other paths misbehave on purpose: /bad_json answers 200 with text that is not JSON, /gateway
answers 504, /broken 500, /slow sleeps `slow_s` before answering, and /compiling reports a syntax
error as a failed compile step (as the service does for compiled languages)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def run_python(request: dict, max_run_s: float) -> dict:
    limit = min(float(request.get("run_timeout") or 10), max_run_s)
    memory = int(request.get("memory_limit_MB") or 1024) * 2**20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", request["code"]], input=request.get("stdin") or "",
                              capture_output=True, text=True, timeout=limit, preexec_fn=cap)
    except subprocess.TimeoutExpired as err:
        ran = {"status": "TimeLimitExceeded", "execution_time": limit, "return_code": None,
               "stdout": (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else err.stdout or "",
               "stderr": ""}
        return {"status": "Failed", "message": "", "compile_result": None, "run_result": ran, "files": {}}
    ran = {"status": "Finished", "execution_time": time.monotonic() - started, "return_code": proc.returncode,
           "stdout": proc.stdout, "stderr": proc.stderr}
    return {"status": "Success" if proc.returncode == 0 else "Failed", "message": "", "compile_result": None,
            "run_result": ran, "files": {}}


def compile_python(request: dict, max_run_s: float) -> dict:
    try:
        compile(request["code"], "main.py", "exec")
    except SyntaxError as err:
        built = {"status": "Finished", "execution_time": 0.0, "return_code": 1, "stdout": "", "stderr": str(err)}
        return {"status": "Failed", "message": "", "compile_result": built, "run_result": None, "files": {}}
    return run_python(request, max_run_s)


class SandboxService:
    """Started on a free local port in a daemon thread; `url(path)` addresses it; `requests` counts
    the POSTs it received by path, `most_at_once` the most it was answering at the same time."""

    def __init__(self, max_run_s: float = 1.0, slow_s: float = 3.0):
        service = self
        self.requests: dict[str, int] = {}
        self.bodies: list[dict] = []
        self.in_flight = self.most_at_once = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests[self.path] = service.requests.get(self.path, 0) + 1
                    service.bodies.append(body)
                    service.in_flight += 1
                    service.most_at_once = max(service.most_at_once, service.in_flight)
                try:
                    self.answer(body)
                finally:
                    with service.lock:
                        service.in_flight -= 1

            def answer(self, body: dict):
                if self.path in ("/gateway", "/broken"):
                    return self.send_error(504 if self.path == "/gateway" else 500)
                if self.path == "/slow":
                    time.sleep(slow_s)
                if self.path in ("/drip", "/drip_headers"):  # a byte every 0.5 s, for 10 s: no read ever times out
                    return self.drip(self.path == "/drip_headers")
                answer = b"<html>not json</html>" if self.path == "/bad_json" else json.dumps(
                    (compile_python if self.path == "/compiling" else run_python)(body, max_run_s)).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except (BrokenPipeError, ConnectionResetError):  # /slow's client gave up waiting
                    pass

            def drip(self, in_headers: bool):
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                try:
                    self.wfile.write(head if in_headers else head + b"\r\n")
                    for _ in range(20):
                        self.wfile.write(b"X-Slow: 1\r\n" if in_headers else b" ")
                        self.wfile.flush()
                        time.sleep(0.5)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):  # quiet: pytest shows failures, not every request
                pass

        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str = "/run_code") -> str:
        return f"http://127.0.0.1:{self.server.server_port}{path}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
