"""`k3 bench serve`'s load generator: streamed completions against a server on this machine, closed loop
(`run_load`: N clients, each sending its next request when the last ends) or open loop (`run_poisson`:
Poisson arrivals), with the figures of each request (`Load`)."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Load:
    """What one load run measured (client side) and the server's peak of running sequences."""

    duration: float
    tokens: int = 0
    requests: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0  # 503: the queue was full
    disconnected: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    peak_running: int = 0
    after: dict = field(default_factory=dict)  # /health once the load is over
    intruder: "Load | None" = None  # `run_load`'s one extra request, counted apart
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def summary(self) -> dict:
        return {
            "tokens_per_s": self.tokens / self.duration,
            "tokens": self.tokens,
            "requests": self.requests,
            "completed": self.completed,
            "failed": self.failed,
            "rejected": self.rejected,
            "disconnected": self.disconnected,
            "ttft_p50_s": pct(self.ttft, 50),
            "ttft_p99_s": pct(self.ttft, 99),
            "itl_p50_ms": 1e3 * pct(self.itl, 50),
            "itl_p99_ms": 1e3 * pct(self.itl, 99),
            "peak_running": self.peak_running,
            "after": self.after,
            "errors": self.errors[:5],
            **({"intruder": self.intruder.summary()} if self.intruder is not None else {}),
        }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_load(
    port: int,
    prompt,
    max_tokens: int,
    clients: int,
    duration: float,
    disconnect: float = 0.0,
    seed: int = 0,
    warmup: float = 0.0,
    intruder: tuple[list[int], int] | None = None,
) -> Load:
    """`clients` threads, each sending streamed completions one after another for `warmup` + `duration`
    seconds; tokens and latencies count in the last `duration` seconds (the window), once the first wave
    of prompts is prefilled. `prompt`: token ids, or a function of a random.Random giving each request's.
    With `disconnect` > 0 that fraction of requests closes its connection at a random token. `intruder`:
    (prompt, max_tokens) of one more request sent as the window opens, whose figures are `load.intruder`'s
    (a long prompt arriving under load: what it does to the others)."""
    load = Load(duration)
    opens = time.perf_counter() + warmup
    end = opens + duration
    if intruder is not None:
        load.intruder = Load(duration)

        def intrude() -> None:
            time.sleep(max(0.0, opens - time.perf_counter()))
            one_request(port, load.intruder, body(*intruder), opens, end, None)

        threading.Thread(target=intrude, daemon=True).start()

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < end:
            cut = rng.randint(1, max_tokens) if rng.random() < disconnect else None
            one_request(port, load, body(prompt(rng) if callable(prompt) else prompt, max_tokens), opens, end, cut)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(warmup + duration * 3 + 120)
    return load


def run_poisson(
    port: int, prompt, max_tokens: int, rate: float, duration: float, seed: int = 0, warmup: float = 0.0
) -> Load:
    """Requests arriving as a Poisson process of `rate` a second (exponential gaps) for `warmup` +
    `duration` seconds, each on a thread of its own (an open loop: arrivals do not wait for answers, as
    users do not); figures as `run_load`'s, requests sent in the window."""
    load = Load(duration)
    rng = random.Random(seed)
    opens = time.perf_counter() + warmup
    end = opens + duration
    threads = []
    while time.perf_counter() < end:
        ids = prompt(rng) if callable(prompt) else prompt
        t = threading.Thread(
            target=one_request, args=(port, load, body(ids, max_tokens), opens, end, None), daemon=True
        )
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join(duration * 3 + 120)
    return load


def body(prompt: list[int], max_tokens: int) -> bytes:
    """A streamed greedy completion of `prompt` (token ids) with usage in every chunk."""
    return json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        }
    ).encode()


def one_request(port: int, load: Load, payload: bytes, opens: float, end: float, cut: int | None) -> None:
    """One streamed completion, its figures added to `load` (tokens in the window [opens, end]; time to
    first token and per-token gaps of requests sent after `opens`); `cut`: close after that many tokens."""
    # a queued request may wait long for its first token: wait until the window is over, not a fixed time
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(5.0, end - time.perf_counter() + 5.0))
    sent = time.perf_counter()
    seen, last, gaps, first, done, error = 0, sent, [], None, False, None
    try:
        conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status == 503:
            r.read()
            with load.lock:
                load.rejected += 1
            time.sleep(float(r.getheader("Retry-After", "1")))
            return
        if r.status != 200:
            error = f"HTTP {r.status}: {r.read()[:200]!r}"
        while error is None:
            line = r.readline()
            if not line:
                error = "the stream ended without [DONE]"
                break
            if line.startswith(b"data: [DONE]"):
                done = True
                break
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
                break
            now = time.perf_counter()
            count = chunk.get("usage", {}).get("completion_tokens", seen)
            if count > seen and opens <= now <= end:
                with load.lock:
                    load.tokens += count - seen
            if count > seen:
                if first is None:
                    first = now - sent
                elif now >= opens:
                    gaps.append((now - last) / (count - seen))
                seen, last = count, now
            if now > end:
                break  # the window is over: leave the rest
            if cut is not None and seen >= cut:
                break
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    with load.lock:
        load.requests += 1
        if error is not None and time.perf_counter() <= end:
            load.failed += 1
            load.errors.append(error)
        elif done:
            load.completed += 1
        elif cut is not None:
            load.disconnected += 1
        if first is not None and sent >= opens:
            load.ttft.append(first)
        load.itl.extend(gaps)
