"""`k3 bench serve`: `k3 serve` under load, kimi-k3-tiny, kimi-linear-tiny and the matched GPT-2 side by side.

Each model (the builds of `k3 bench models`, vocabulary 4,096, with a BPE tokenizer of that size trained on
k3's own source) is saved to a folder and served by a `k3 serve` process of its own, one per model and
context, with one cache budget (`--cache-memory`) for all. A bounded load generator in this process
(threads, the standard library's HTTP client) keeps N clients busy for a stated duration: each sends a
streamed completion of a fixed prompt length and output length (`ignore_eos`, greedy), reads it to the
end and sends the next. Tokens are counted from vLLM's `continuous_usage_stats` (usage in every chunk),
so a token whose text is held back (half a character) still counts. `stream_interval` > 1 runs every server
with `--stream-interval` (an event every N tokens: less of each token's HTTP cost on the shared cores).

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
from pathlib import Path

import torch

from ..runtime import matmul_gflops
from ..serve.engine import PREFILL_CHUNK, prefill_bytes, sequence_bytes
from .load import Load, pct, run_load, run_poisson  # noqa: F401 (Load, pct: this module's API too)
from .runners import GPT2, K3_TINY, KIMI_LINEAR, LABELS, build_k3

MODELS = (K3_TINY, KIMI_LINEAR, GPT2)


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

    def __init__(
        self,
        checkpoint: Path,
        cache_memory: int,
        threads: int | None,
        max_queue: int = 1024,
        flags: tuple[str, ...] = (),
    ):
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
        argv += list(flags)
        self.proc = subprocess.Popen(
            argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        self.port = None
        deadline = time.time() + 1200  # a first --compile compiles a step per batch size
        while self.port is None:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"k3 bench serve: k3 serve exited with {self.proc.returncode}")
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            self.port = int(found.group(1)) if found else None
            if time.time() > deadline:
                self.proc.kill()
                raise RuntimeError("k3 bench serve: k3 serve did not start in 1,200 s")
            if self.port is not None:
                self.started = line.strip()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep its pipe drained
        while "--compile" in flags and self.health().get("buckets_to_compile"):  # measure the compiled steps
            if time.time() > deadline:
                self.proc.kill()
                raise RuntimeError("k3 bench serve: k3 serve did not compile its steps in 1,200 s")
            time.sleep(1)

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


def serve_case(
    checkpoint: Path,
    config,
    prompt,
    output: int,
    clients: int,
    duration: float,
    budget: int,
    threads: int | None,
    disconnect: float = 0.0,
    warmup: float = 0.0,
    flags: tuple[str, ...] = (),
    rate: float | None = None,
    intruder: tuple[list[int], int] | None = None,
) -> dict:
    """One server (`k3 serve` with `flags`), one load (`clients` closed-loop clients, or Poisson arrivals
    at `rate` a second): the load's figures, the server's start-up line, its peak and what is left once
    the load is over."""
    server = ServerProcess(checkpoint, budget, threads, flags=flags)
    try:
        if rate is None:
            load = run_load(
                server.port, prompt, output, clients, duration, disconnect, warmup=warmup, intruder=intruder
            )
        else:
            load = run_poisson(server.port, prompt, output, rate, duration, warmup=warmup)
        deadline = time.time() + 60
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
    out["flags"] = list(flags)
    out["server"] = server.started
    length = len(prompt) if not callable(prompt) else len(prompt(random.Random(0)))
    out["fits_by_accounting"] = budget // sequence_bytes(config, length + output - 1, 4)
    return out


def engine_flags(context: int, clients: int, compile: bool, *more: str) -> tuple[str, ...]:
    """`k3 serve` flags for a case: slots for the clients, each of `context` tokens; eager or compiled;
    no prefix cache unless `more` says (the loads that send one prompt to every client measure decoding)."""
    prefix = () if any("prefix-cache" in flag for flag in more) else ("--no-prefix-cache",)
    flags = ("--max-model-len", str(context), "--max-running", str(clients))
    return flags + ("--compile" if compile else "--no-compile",) + prefix + more


PARTS = ("models", "batching", "engine", "poisson", "prefix", "long")
LONG_PROMPT = 16384  # the `long` part's prompt, arriving under load


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
    parts=PARTS,
    say=print,
    stream_interval: int = 1,
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
        "stream_interval": stream_interval,
        "matched_gpt2": gpt,
        "cases": {},
    }
    long = max(contexts)
    streaming = ("--stream-interval", str(stream_interval)) if stream_interval > 1 else ()
    with tempfile.TemporaryDirectory(prefix="k3-bench-serve-") as tmp:
        folders = {}
        for name, model in models.items():
            folders[name] = Path(tmp) / name
            model.save_pretrained(folders[name])
            tokenizer.save(folders[name] / "tokenizer.json")
        rng = torch.Generator().manual_seed(0)

        def prompt_of(n: int) -> list[int]:
            return torch.randint(0, 4096, (n,), generator=rng).tolist()

        def case(key: str, name: str, prompt, output: int, n: int, flags, **kw) -> dict:
            out = serve_case(
                folders[name],
                models[name].config,
                prompt,
                output,
                n,
                duration,
                kw.pop("cache_memory", cache_memory),
                threads,
                flags=flags + streaming,
                warmup=kw.pop("warmup", warmup),
                **kw,
            )
            report["cases"][key] = out
            say("  " + line(out))
            return out

        if soak:
            say(
                f"soak: kimi-k3-tiny, {clients} clients for {soak:.0f} s, context 256, {disconnect:.0%} of requests "
                f"disconnect at a random token; compiled steps, prefix cache on"
            )
            flags = engine_flags(256, clients, True, "--prefix-cache") + streaming
            out = serve_case(
                folders[K3_TINY],
                models[K3_TINY].config,
                prompt_of(128),
                128,
                clients,
                soak,
                cache_memory,
                threads,
                disconnect,
                flags=flags,
            )
            report["soak"] = out
            say(
                f"  {out['requests']} requests: {out['completed']} completed, {out['disconnected']} disconnected "
                f"on purpose, {out['failed']} failed, {out['rejected']} rejected (503); afterwards: running "
                f"{out['after']['running']}, waiting {out['after']['waiting']}, slots free "
                f"{out['after'].get('slots_free')} of {out['after'].get('slots')}, cache bytes reserved "
                f"{out['after']['cache_bytes_reserved']}; exit code {out['exit_code']}"
            )
            return _write(report, json_path)
        if "models" in parts:
            for context in contexts:
                half = context // 2
                prompt = prompt_of(half)
                for name in MODELS:
                    say(
                        f"{LABELS[name]} at {context} tokens ({half} prompt + {context - half} output), {clients} "
                        f"clients, eager steps, {warmup:.0f} s warm-up, then {duration:.0f} s measured ..."
                    )
                    case(
                        f"{name}@{context}",
                        name,
                        prompt,
                        context - half,
                        clients,
                        engine_flags(context, clients, False),
                    )
        if "engine" in parts:
            for context in contexts:
                half = context // 2
                prompt = prompt_of(half)
                for compiled in (False, True):
                    key = f"{'compiled' if compiled else 'eager'}@{context}"
                    if not compiled and f"{K3_TINY}@{context}" in report["cases"]:
                        report["cases"][key] = report["cases"][f"{K3_TINY}@{context}"]  # the same run
                        continue
                    say(f"engine: kimi-k3-tiny at {context} tokens, {clients} clients, {key.split('@')[0]} steps ...")
                    case(key, K3_TINY, prompt, context - half, clients, engine_flags(context, clients, compiled))
        if "batching" in parts:
            say(f"batching: kimi-k3-tiny at {min(contexts)} tokens, 1 client, then 16 ...")
            half = min(contexts) // 2
            prompt = prompt_of(half)
            for n in (1, 16):
                flags = engine_flags(min(contexts), 16, False)
                case(f"batching-{n}", K3_TINY, prompt, min(contexts) - half, n, flags)
        if "poisson" in parts:
            prompt_tokens, output = long // 2, 128
            shared = prompt_of(prompt_tokens)
            chunked = engine_flags(long, clients, True, "--prefill-chunk", str(PREFILL_CHUNK))
            say(
                f"poisson: kimi-k3-tiny, {prompt_tokens}-token prompts, {output} out; first its saturation, "
                "16 clients ..."
            )
            probe = case("poisson-saturation", K3_TINY, shared, output, 16, chunked)
            # near saturation: 80% of the requests it completes a second (in the warm-up and the window)
            rate = 0.8 * probe["completed"] / (warmup + duration)
            report["poisson_rate"] = rate
            say(f"poisson: arrivals at {rate:.2f}/s, prefill chunked ({PREFILL_CHUNK} tokens a turn) and whole ...")
            for chunk in (PREFILL_CHUNK, 0):
                flags = engine_flags(long, clients, True, "--prefill-chunk", str(chunk))
                case(f"poisson-chunk-{chunk}", K3_TINY, shared, output, clients, flags, rate=rate)
        if "prefix" in parts:
            system = prompt_of(1024)
            say(
                "prefix: kimi-k3-tiny, a 1,024-token system prompt then 32-token turns, 32 out, 16 clients, "
                "prefix cache on and off ..."
            )

            def turn(r: random.Random) -> list[int]:
                return system + [r.randrange(4096) for _ in range(32)]

            for on in (True, False):
                flags = engine_flags(2048, 16, True, "--prefix-cache" if on else "--no-prefix-cache")
                case(f"prefix-{'on' if on else 'off'}", K3_TINY, turn, 32, 16, flags)
        if "long" in parts:
            context, streams = LONG_PROMPT + 64, 16
            say(
                f"long: kimi-k3-tiny, {streams} clients streaming 128-token prompts (128 out), eager steps; then "
                f"the same with one {LONG_PROMPT:,}-token prompt arriving as the window opens ..."
            )
            intruder = (prompt_of(LONG_PROMPT), 8)
            # a row for each stream and the long prompt, beside a full piece of it
            config = models[K3_TINY].config
            memory = (streams + 1) * sequence_bytes(config, context, 4) + prefill_bytes(config, 512, context, 4)
            for arrives in (False, True):
                flags = engine_flags(context, streams + 1, False)
                case(f"long-{'with' if arrives else 'without'}", K3_TINY, prompt_of(128), 128, streams, flags,
                     intruder=intruder if arrives else None, cache_memory=memory)  # fmt: skip
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
        + (f"; prefix cache hit rate {prefix['hit_rate']:.0%}" if (prefix := case["after"].get("prefix_cache")) else "")
        + (
            f"; the long prompt: TTFT {intruder['ttft_p50_s']:.2f} s, {intruder['failed']} failed"
            if (intruder := case.get("intruder"))
            else ""
        )
    )


def targets(report: dict, contexts) -> list[dict]:
    cases, long = report["cases"], max(contexts)
    out = []

    def target(text: str, value: float, holds: bool) -> None:
        out.append({"target": text, "value": value, "holds": holds})

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    if f"{GPT2}@{long}" in cases:
        k3, gpt = cases[f"{K3_TINY}@{long}"], cases[f"{GPT2}@{long}"]
        value = ratio(k3["peak_running"], gpt["peak_running"])
        target(f"kimi-k3-tiny admits >= 20x the matched GPT-2's concurrent sequences at {long}", value, value >= 20)
        value = ratio(k3["tokens_per_s"], gpt["tokens_per_s"])
        target(f"kimi-k3-tiny serves >= 3x the matched GPT-2's output tokens/s at {long}", value, value >= 3)
    if "batching-16" in cases:
        value = ratio(cases["batching-16"]["tokens_per_s"], cases["batching-1"]["tokens_per_s"])
        target("16 clients' total throughput >= 4x one client's", value, value >= 4)
    if f"compiled@{long}" in cases:
        value = ratio(cases[f"compiled@{long}"]["tokens_per_s"], cases[f"eager@{long}"]["tokens_per_s"])
        target(f"compiled engine >= 2x the eager engine's output tokens/s at {long}", value, value >= 2)
    if "poisson-chunk-0" in cases:
        chunked, whole = cases[f"poisson-chunk-{PREFILL_CHUNK}"], cases["poisson-chunk-0"]
        value = ratio(chunked["itl_p99_ms"], whole["itl_p99_ms"])
        target("Poisson: per-token p99 with chunked prefill <= 0.5x without", value, value <= 0.5)
        value = ratio(chunked["itl_p50_ms"], whole["itl_p50_ms"])
        target("Poisson: per-token p50 with chunked prefill <= 1.1x without", value, value <= 1.1)
    if "prefix-on" in cases:
        value = ratio(cases["prefix-on"]["ttft_p50_s"], cases["prefix-off"]["ttft_p50_s"])
        target("shared prefix: median time to first token with the prefix cache <= 0.3x without", value, value <= 0.3)
    if "long-with" in cases:
        without, turn = cases["long-without"]["itl_p99_ms"], cases["long-without"]["itl_p50_ms"]  # a token a turn
        value = (cases["long-with"]["itl_p99_ms"] - without) / turn  # what the long prompt adds to the p99
        target(f"a {LONG_PROMPT:,}-token prompt under load delays the others' next token <= 2 turns (p99)", value,
               value <= 2)  # fmt: skip
    failed = sum(c["failed"] + c.get("intruder", {}).get("failed", 0) for c in cases.values())
    target("0 failed requests", float(failed), failed == 0)
    return out


def _write(report: dict, json_path: str | None) -> dict:
    if json_path:
        from .timing import write_report

        write_report(json_path, report, "serve")
    return report
