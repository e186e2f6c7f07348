"""`k3 bench serve`: `k3 serve` under load, kimi-k3-tiny, kimi-linear-tiny and the matched GPT-2 side by side.

Each model (the builds of `k3 bench models`, vocabulary 4,096, with a BPE tokenizer of that size trained on
k3's own source) is saved to a folder and served by a `k3 serve` process of its own, one per model and
context, with one cache budget (`--cache-memory`) for all. A bounded load generator in this process
(threads, the standard library's HTTP client) keeps N clients busy for a stated duration: each sends a
streamed completion of a fixed prompt length and output length (`ignore_eos`, greedy), reads it to the
end and sends the next. Tokens are counted from vLLM's `continuous_usage_stats` (usage in every chunk),
so a token whose text is held back (half a character) still counts.

Reported per model and context (prompt + output = context, half each):
- output tokens/s over the window (tokens received while it lasted, over its length);
- time to first token (queueing included) and per-token latency (the gap between chunks over the
  tokens they carry), p50 and p99;
- the most sequences the server had running at once (`/health`'s peak_running) within the budget, and
  what k3's cache accounting says fits (`k3.serve.sequence_bytes`);
- failed requests (an error status other than 503, a stream that ended without [DONE]).
Then batching: kimi-k3-tiny at the short context with 1 client and with 16 (total throughput ratio).
`--soak SECONDS` runs instead one long load on kimi-k3-tiny whose clients disconnect at random mid-stream,
and reports failures and the slots and cache bytes still held once it is over (both must be 0).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..runtime import matmul_gflops
from ..serve.engine import sequence_bytes
from .runners import GPT2, K3_TINY, KIMI_LINEAR, LABELS, build_k3

MODELS = (K3_TINY, KIMI_LINEAR, GPT2)


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
        }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def bench_tokenizer():
    """A 4,096-entry byte-level BPE (the bench models' vocabulary) trained on k3's own source files."""
    from ..tokenizer import train_bpe

    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text() for p in sorted(root.rglob("*.py"))]
    tokenizer = train_bpe(texts, 4096)
    if tokenizer.vocab_size != 4096:
        raise RuntimeError(f"k3 bench serve: the tokenizer has {tokenizer.vocab_size} entries, not 4096")
    return tokenizer


class ServerProcess:
    """`k3 serve` in a process of its own, on a free port; `stop()` sends SIGTERM and returns its exit code."""

    def __init__(self, checkpoint: Path, cache_memory: int, threads: int | None, max_queue: int = 1024):
        argv = [
            sys.executable,
            "-m",
            "k3",
            "serve",
            "--checkpoint",
            str(checkpoint),
            "--port",
            "0",
            "--cache-memory",
            str(cache_memory),
            "--max-queue",
            str(max_queue),
            "--log-level",
            "warning",
        ]
        if threads:
            argv += ["--threads", str(threads)]
        self.proc = subprocess.Popen(
            argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        self.port = None
        deadline = time.time() + 180
        while self.port is None:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"k3 bench serve: k3 serve exited with {self.proc.returncode}")
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            self.port = int(found.group(1)) if found else None
            if time.time() > deadline:
                self.proc.kill()
                raise RuntimeError("k3 bench serve: k3 serve did not start in 180 s")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep its pipe drained

    def health(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/health")
        out = json.loads(conn.getresponse().read())
        conn.close()
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def run_load(
    port: int,
    prompt: list[int],
    max_tokens: int,
    clients: int,
    duration: float,
    disconnect: float = 0.0,
    seed: int = 0,
    warmup: float = 0.0,
) -> Load:
    """`clients` threads, each sending streamed completions one after another for `warmup` + `duration`
    seconds; tokens and latencies count in the last `duration` seconds (the window), once the first wave
    of prompts is prefilled. With `disconnect` > 0 that fraction of requests closes its connection at a
    random token."""
    load = Load(duration)
    lock = threading.Lock()
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        }
    ).encode()
    opens = time.perf_counter() + warmup
    end = opens + duration

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < end:
            cut = rng.randint(1, max_tokens) if rng.random() < disconnect else None
            one_request(body, cut)

    def one_request(payload: bytes, cut: int | None) -> None:
        # a queued request may wait long for its first token: wait until the window is over, not a fixed time
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(5.0, end - time.perf_counter() + 5.0))
        sent = time.perf_counter()
        seen, last, gaps, first, done, error = 0, sent, [], None, False, None
        try:
            conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status == 503:
                r.read()
                with lock:
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
                    with lock:
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
        with lock:
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

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(warmup + duration * 3 + 120)
    return load


def serve_case(
    checkpoint: Path,
    config,
    prompt: list[int],
    output: int,
    clients: int,
    duration: float,
    budget: int,
    threads: int | None,
    disconnect: float = 0.0,
    warmup: float = 0.0,
) -> dict:
    """One server, one load: the load's figures, the server's peak and what is left once it is over."""
    server = ServerProcess(checkpoint, budget, threads)
    try:
        load = run_load(server.port, prompt, output, clients, duration, disconnect, warmup=warmup)
        deadline = time.time() + 30
        while True:  # the last cancelled rows leave at the engine's next turn
            load.after = server.health()
            if load.after["running"] == 0 and load.after["waiting"] == 0 or time.time() > deadline:
                break
            time.sleep(0.1)
        load.peak_running = load.after["peak_running"]
    finally:
        code = server.stop()
    out = load.summary()
    out["exit_code"] = code
    out["fits_by_accounting"] = budget // sequence_bytes(config, len(prompt) + output - 1, 4)
    return out


def run(
    quick: bool = False,
    duration: float | None = None,
    clients: int = 64,
    contexts=(256, 4096),
    cache_memory: int = 128 * 2**20,
    threads: int | None = None,
    soak: float | None = None,
    disconnect: float = 0.3,
    warmup: float | None = None,
    json_path: str | None = None,
    say=print,
) -> dict:
    duration = duration or (20.0 if quick else 60.0)
    warmup = (15.0 if quick else 30.0) if warmup is None else warmup
    gemm = matmul_gflops()
    say(
        f"k3 bench serve: {torch.get_num_threads()} threads here, matmul {gemm:.1f} GFLOP/s (1024^3 float32); "
        f"cache budget {cache_memory:,} bytes; the load generator shares this machine's cores with the server"
    )
    tokenizer = bench_tokenizer()
    models, gpt = build_k3(MODELS, max(contexts))
    report = {
        "gemm_gflops": gemm,
        "cache_memory": cache_memory,
        "clients": clients,
        "duration_s": duration,
        "warmup_s": warmup,
        "matched_gpt2": gpt,
        "cases": {},
    }
    with tempfile.TemporaryDirectory(prefix="k3-bench-serve-") as tmp:
        folders = {}
        for name, model in models.items():
            folders[name] = Path(tmp) / name
            model.save_pretrained(folders[name])
            tokenizer.save(folders[name] / "tokenizer.json")
        rng = torch.Generator().manual_seed(0)

        def prompt_of(n: int) -> list[int]:
            return torch.randint(0, 4096, (n,), generator=rng).tolist()

        if soak:
            say(
                f"soak: kimi-k3-tiny, {clients} clients for {soak:.0f} s, context 256, {disconnect:.0%} of requests "
                f"disconnect at a random token"
            )
            case = serve_case(
                folders[K3_TINY],
                models[K3_TINY].config,
                prompt_of(128),
                128,
                clients,
                soak,
                cache_memory,
                threads,
                disconnect,
            )
            report["soak"] = case
            say(
                f"  {case['requests']} requests: {case['completed']} completed, {case['disconnected']} disconnected "
                f"on purpose, {case['failed']} failed, {case['rejected']} rejected (503); afterwards: running "
                f"{case['after']['running']}, waiting {case['after']['waiting']}, cache bytes reserved "
                f"{case['after']['cache_bytes_reserved']}; exit code {case['exit_code']}"
            )
            return _write(report, json_path)
        for context in contexts:
            half = context // 2
            prompt = prompt_of(half)
            for name in MODELS:
                say(
                    f"{LABELS[name]} at {context} tokens ({half} prompt + {context - half} output), {clients} clients, "
                    f"{warmup:.0f} s warm-up, then {duration:.0f} s measured ..."
                )
                case = serve_case(
                    folders[name],
                    models[name].config,
                    prompt,
                    context - half,
                    clients,
                    duration,
                    cache_memory,
                    threads,
                    warmup=warmup,
                )
                report["cases"][f"{name}@{context}"] = case
                say("  " + line(case))
        say(f"batching: kimi-k3-tiny at {min(contexts)} tokens, 1 client, then 16 ...")
        half = min(contexts) // 2
        prompt = prompt_of(half)
        for n in (1, 16):
            case = serve_case(
                folders[K3_TINY],
                models[K3_TINY].config,
                prompt,
                min(contexts) - half,
                n,
                duration,
                cache_memory,
                threads,
                warmup=warmup,
            )
            report["cases"][f"batching-{n}"] = case
            say(f"  {n} client(s): " + line(case))
    report["targets"] = targets(report, contexts)
    for t in report["targets"]:
        say(f"target: {t['target']}: {t['value']:.2f} -> {'holds' if t['holds'] else 'MISSED'}")
    return _write(report, json_path)


def line(case: dict) -> str:
    if math.isnan(case["ttft_p50_s"]):
        ttft = "TTFT: no request began in the window (all began in the warm-up)"
    else:
        ttft = f"TTFT p50 {case['ttft_p50_s']:.2f} s p99 {case['ttft_p99_s']:.2f} s"
    return (
        f"{case['tokens_per_s']:.0f} output tokens/s; {ttft}; "
        f"per token p50 {case['itl_p50_ms']:.1f} ms p99 {case['itl_p99_ms']:.1f} ms; "
        f"peak running {case['peak_running']} (accounting fits {case['fits_by_accounting']}); "
        f"{case['completed']} completed, {case['failed']} failed"
    )


def targets(report: dict, contexts) -> list[dict]:
    cases, long = report["cases"], max(contexts)
    k3, gpt = cases[f"{K3_TINY}@{long}"], cases[f"{GPT2}@{long}"]
    one, many = cases["batching-1"], cases["batching-16"]
    failed = sum(c["failed"] for c in cases.values())
    return [
        {
            "target": f"kimi-k3-tiny admits >= 20x the matched GPT-2's concurrent sequences at {long}",
            "value": k3["peak_running"] / max(gpt["peak_running"], 1),
            "holds": k3["peak_running"] >= 20 * gpt["peak_running"],
        },
        {
            "target": f"kimi-k3-tiny serves >= 3x the matched GPT-2's output tokens/s at {long}",
            "value": k3["tokens_per_s"] / max(gpt["tokens_per_s"], 1e-9),
            "holds": k3["tokens_per_s"] >= 3 * gpt["tokens_per_s"],
        },
        {
            "target": "16 clients' total throughput >= 4x one client's",
            "value": many["tokens_per_s"] / max(one["tokens_per_s"], 1e-9),
            "holds": many["tokens_per_s"] >= 4 * one["tokens_per_s"],
        },
        {"target": "0 failed requests", "value": float(failed), "holds": failed == 0},
    ]


def _write(report: dict, json_path: str | None) -> dict:
    if json_path:
        from .timing import write_report

        write_report(json_path, report, "serve")
    return report
