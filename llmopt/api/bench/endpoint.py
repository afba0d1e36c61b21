"""Any OpenAI-compatible server as a benchmark engine: streaming /v1/completions at a concurrency.

Only the address the user gives is contacted (standard library HTTP, no proxies). Each request
sends a synthetic prompt as text that the model's tokenizer reads as exactly the asked length
(prompts.prompt_text: servers such as llama-cpp-python's take no token ids),
asks for `gen` tokens greedily and streams them; TTFT is the time to the first streamed token,
end-to-end latency the time to the last byte. `concurrency` workers send `requests` requests in
all, each as soon as the worker's last one finished, and stop at `time_limit` seconds.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from llmopt.errors import InputError, OptionError


@dataclass
class RequestRecord:
    ok: bool
    ttft_s: float | None  # request sent -> first streamed token
    e2e_s: float  # request sent -> stream finished
    completion_tokens: int  # tokens streamed (the server's usage count when it sends one)
    prompt_tokens: int | None  # the server's usage count, when it sends one
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int | None
    base_path: str  # ".../v1"

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise OptionError(f"<endpoint> {url!r}: expected an http:// or https:// address, e.g. http://127.0.0.1:8080/v1")
        try:
            port = parts.port
        except ValueError:
            raise OptionError(f"<endpoint> {url!r}: bad port") from None
        path = parts.path.rstrip("/").removesuffix("/completions")
        return cls(parts.scheme, parts.hostname, port, path or "/v1")

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}{f':{self.port}' if self.port else ''}{self.base_path}"


def served_models(endpoint: Endpoint, timeout: float = 10.0) -> list[str]:
    """The ids GET /models lists; a one-line InputError when nothing answers there."""
    conn = endpoint.connect(timeout)
    try:
        conn.request("GET", f"{endpoint.base_path}/models")
        response = conn.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as e:
        raise InputError(f"{endpoint}: cannot reach the server ({_reason(e)}); is it running?") from None
    finally:
        conn.close()
    if response.status != 200:
        raise InputError(f"{endpoint}/models answered HTTP {response.status}; is this an OpenAI-compatible API?")
    try:
        return [str(m["id"]) for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise InputError(f"{endpoint}/models: not an OpenAI model list") from None


def stream_completion(endpoint: Endpoint, model: str, prompt: str, gen: int, timeout: float) -> RequestRecord:
    """One streamed completion of `prompt`, timed."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
    t0 = time.perf_counter()
    first, tokens, usage = None, 0, None
    conn = endpoint.connect(timeout)
    try:
        conn.request("POST", f"{endpoint.base_path}/completions", body, {"Content-Type": "application/json",
                                                                         "Accept": "text/event-stream"})  # fmt: skip
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read(300).decode("utf-8", "replace").replace("\n", " ")
            return RequestRecord(False, None, time.perf_counter() - t0, 0, None, f"HTTP {response.status}: {detail}")
        for raw in response:  # server-sent events: "data: {json}" lines, "data: [DONE]" at the end
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            choice = (event.get("choices") or [{}])[0]
            # a token's chunk; the closing chunk (finish_reason set, no text) is not one
            if choice and (choice.get("text") or choice.get("finish_reason") is None):
                tokens += 1
                if first is None:
                    first = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
    except (OSError, http.client.HTTPException, ValueError) as e:
        return RequestRecord(False, None if first is None else first - t0, time.perf_counter() - t0, tokens, None, _reason(e))
    finally:
        conn.close()
    end = time.perf_counter()
    if usage and isinstance(usage.get("completion_tokens"), int):
        tokens = usage["completion_tokens"]
    prompt_tokens = usage.get("prompt_tokens") if usage else None
    if first is None:
        return RequestRecord(False, None, end - t0, 0, prompt_tokens, "the stream ended without a token")
    return RequestRecord(True, first - t0, end - t0, tokens, prompt_tokens)


def run_requests(endpoint: Endpoint, model: str, prompts: list[str], gen: int, concurrency: int,
                 time_limit: float) -> tuple[list[RequestRecord], float]:
    """Send every prompt once, `concurrency` at a time, until done or `time_limit` seconds have passed.
    Returns the records of the requests sent (in prompt order) and the wall time."""
    records: list[RequestRecord | None] = [None] * len(prompts)
    lock = threading.Lock()
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + time_limit

    def worker() -> None:
        nonlocal next_index
        while True:
            with lock:
                i = next_index
                next_index += 1
            left = deadline - time.perf_counter()
            if i >= len(prompts) or left <= 0:
                return
            records[i] = stream_completion(endpoint, model, prompts[i], gen, timeout=left)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.perf_counter(), 0) + 5)
    wall = time.perf_counter() - t0
    return [r for r in records if r is not None], wall


def _reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
