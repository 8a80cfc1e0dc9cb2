"""A stand-in for llama.cpp's `llama-server`, speaking the few endpoints the bench adapter uses.

Run as `python fake_llama_server.py [llama-server flags]`. `--version` prints what the real one
prints. The server answers /health, /props and /completion (prompt as token ids) with the response
shape of llama.cpp b11434: it "generates" the prompt's tokens in reverse order, so that outputs are
deterministic and differ from any model's. With `--spec-type` it reports drafted/accepted counts.
It writes its pid to $FAKE_LLAMA_PIDFILE (appending), so tests can check it was stopped, and
$FAKE_LLAMA_ARGV receives its argument list. $FAKE_LLAMA_SIGILL=start|prompt makes it die of an
illegal instruction (SIGILL) while starting or on its first /completion, unless it was given
`--no-repack`: what llama.cpp's AMX path does on some Xeons.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def illegal_instruction() -> None:
    """Die as a process that executed an instruction its CPU refuses (exit status -4)."""
    sys.stdout.flush()
    # To this very thread (Python leaves SIGILL's default action, terminate, in place): a signal to the
    # process may land on another thread while this one still answers the request.
    signal.pthread_kill(threading.get_ident(), signal.SIGILL)
    time.sleep(60)  # never reached; and never an answer


def main(argv: list[str]) -> int:
    if "--version" in argv:
        print("version: 0.6.0-dev (build 4242, commit fake)\nbuilt with fake for testing", file=sys.stderr)
        return 0
    port = int(argv[argv.index("--port") + 1])
    speculative = "--spec-type" in argv
    if os.environ.get("FAKE_LLAMA_PIDFILE"):
        with open(os.environ["FAKE_LLAMA_PIDFILE"], "a") as f:
            f.write(f"{os.getpid()}\n")
    if os.environ.get("FAKE_LLAMA_ARGV"):
        with open(os.environ["FAKE_LLAMA_ARGV"], "a") as f:
            f.write(json.dumps(argv) + "\n")
    crash = "" if "--no-repack" in argv else os.environ.get("FAKE_LLAMA_SIGILL", "")
    if crash == "start":
        illegal_instruction()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/props":
                self._send(200, {"build_info": "b4242-fake", "total_slots": 1})
            else:
                self._send(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]
            if self.path != "/completion" or not all(isinstance(t, int) for t in prompt):
                self._send(400, {"error": {"code": 400, "message": "bad request", "type": "invalid_request_error"}})
                return
            if crash == "prompt":
                illegal_instruction()
            n = int(body["n_predict"])
            tokens = list(reversed(prompt))[:n]
            timings = {"cache_n": 0, "prompt_n": len(prompt), "prompt_ms": 10.0 * len(prompt),
                       "predicted_n": len(tokens), "predicted_ms": 20.0 * len(tokens)}
            if speculative and len(tokens) > 2:
                timings.update(draft_n=len(tokens), draft_n_accepted=len(tokens) // 2)
            self._send(200, {"content": "", "tokens": tokens, "stop_type": "limit", "tokens_predicted": len(tokens),
                             "tokens_evaluated": len(prompt), "timings": timings})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
