"""`k3 serve` on the command line: its one-line errors, and (slow) a real process that SIGTERM or SIGHUP
(a closed terminal) stops while a request runs: the request finishes, the process exits 0."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from k3.models import CausalLM, get_config
from k3.serve import parse_bytes
from k3.tokenizer import byte_tokenizer
from tests.commands import fails


def test_errors(capsys, tmp_path):
    fails(capsys, ["serve", "--checkpoint", str(tmp_path / "missing")], "no such folder")
    fails(capsys, ["serve", "--checkpoint", str(tmp_path), "--cache-memory", "lots"], "512MiB")
    fails(capsys, ["serve", "--checkpoint", str(tmp_path), "--port", "-1"], "--port")
    fails(capsys, ["serve", "--checkpoint", str(tmp_path), "--port", "70000"], "--port", "in [0, 65535]", "70000")
    fails(
        capsys,
        ["serve", "--checkpoint", str(tmp_path), "--cache-memory", "1000TiB", "--device", "cpu"],
        "--cache-memory 1000TiB",
        "1,099,511,627,776,000 bytes",
        "available",
    )
    fails(capsys, ["serve", "--checkpoint", str(tmp_path), "--max-request-bytes", "0"], "--max-request-bytes", "512MiB")
    fails(capsys, ["serve", "--checkpoint", str(tmp_path), "--max-prompt-tokens", "0"], "--max-prompt-tokens")
    fails(capsys, ["serve", "--checkpoint", str(tmp_path), "--max-model-len", "1"], "--max-model-len", ">= 2", "'1'")
    fails(  # before the checkpoint is read: no prompt could have that many tokens
        capsys,
        ["serve", "--checkpoint", str(tmp_path / "missing"), "--max-model-len", "4096", "--max-prompt-tokens", "4096"],
        "--max-prompt-tokens 4096: --max-model-len 4096 leaves a prompt 4095 tokens at most",
    )
    fails(capsys, ["serve", "--checkpoint", str(tmp_path), "--prefill-chunk", "-1"], "--prefill-chunk")
    serve = ["serve", "--checkpoint", str(tmp_path)]
    for small in ("1", "63"):
        fails(capsys, [*serve, "--prefill-chunk", small], "--prefill-chunk", "at least 64")
    for blank in ("", "  "):
        fails(capsys, [*serve, "--served-model-name", blank], "--served-model-name", "blank")
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(tmp_path)
    byte_tokenizer().save(tmp_path / "tokenizer.json")
    fails(
        capsys,
        ["serve", "--checkpoint", str(tmp_path), "--port", "0", "--cache-memory", "1MiB", "--max-model-len", "8192"],
        "--cache-memory 1MiB",
        "does not hold one row of 8,192 tokens",
        "--max-model-len",
    )
    fails(  # --max-model-len's default is the model's: known once it is loaded
        capsys,
        ["serve", "--checkpoint", str(tmp_path), "--port", "0", "--max-prompt-tokens", "100000", "--device", "cpu"],
        "--max-prompt-tokens 100000: --max-model-len 4096 (its default for this model) leaves a prompt 4095",
    )


def test_a_damaged_tokenizer_config_is_one_line_before_the_model_loads(capsys, tmp_path, monkeypatch):
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(tmp_path)
    byte_tokenizer().save(tmp_path / "tokenizer.json")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the checkpoint's chat template was checked")

    monkeypatch.setattr(CausalLM, "from_pretrained", no_model)
    serve = ["serve", "--checkpoint", str(tmp_path), "--device", "cpu", "--port", "0"]
    (tmp_path / "tokenizer_config.json").write_text("[1,2]")
    fails(capsys, serve, str(tmp_path / "tokenizer_config.json"), "a JSON array, expected an object")
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": 5}')
    fails(capsys, serve, str(tmp_path / "tokenizer_config.json"), "bos_token is a JSON number")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    fails(capsys, serve, str(tmp_path / "chat_template.jinja"), "not valid Jinja", "(line 1)")


def test_a_bad_host_or_a_busy_port_is_one_line_before_the_checkpoint_is_read(capsys, tmp_path, monkeypatch):
    """--host:--port is bound first (an empty folder as the checkpoint: nothing of it is read before), each
    failure one line naming the flag; with a usable address the command goes on to the checkpoint."""
    import socket

    serve = ["serve", "--checkpoint", str(tmp_path), "--device", "cpu"]
    fails(capsys, [*serve, "--host", "999.1.1.1"], "--host 999.1.1.1: not an address, nor a name that resolves")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        fails(capsys, [*serve, "--port", port], f"--port {port}: already in use on 127.0.0.1", "or 0 for any free one")
    fails(capsys, [*serve, "--port", "0"], str(tmp_path), "no config.json")  # bound, then the empty folder refused


def test_api_key_sources(capsys, tmp_path, monkeypatch):
    """The key from --api-key-file (the whitespace around it dropped), --api-key or $K3_API_KEY, in that
    order; one that no client could send (blank, whitespace at an end, not printable ASCII) and a file that
    cannot be read refused in one line naming where the key came from, without repeating it."""
    from k3.cli.parser import build_parser
    from k3.cli.serve import read_api_key

    def key(*flags):
        return read_api_key(build_parser().parse_args(["serve", "--checkpoint", str(tmp_path), *flags]))

    monkeypatch.delenv("K3_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    (tmp_path / "key").write_text("sk-file\n")
    assert key() is None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")  # a client's key to OpenAI: not this server's
    assert key() is None
    monkeypatch.setenv("K3_API_KEY", "sk-env")
    assert key() == "sk-env" and key("--api-key", "sk-flag") == "sk-flag"
    assert key("--api-key-file", str(tmp_path / "key")) == "sk-file"
    serve = ["serve", "--checkpoint", str(tmp_path)]
    unsendable = (("", "empty"), ("   ", "whitespace only"), (" sk-x", "begins or ends"), ("sk-\u00e9", "ASCII"))
    for value, words in unsendable:
        monkeypatch.setenv("K3_API_KEY", value)
        err = fails(capsys, serve, "$K3_API_KEY", words)
        assert "sk-" not in err, err
        fails(capsys, [*serve, "--api-key", value], "--api-key:", words)
    (tmp_path / "blank").write_text("\n")
    fails(capsys, [*serve, "--api-key-file", str(tmp_path / "blank")], "--api-key-file", "blank")
    fails(capsys, [*serve, "--api-key-file", str(tmp_path / "none")], "--api-key-file", "cannot read", "No such file")
    fails(capsys, [*serve, "--api-key-file", str(tmp_path)], "--api-key-file", "cannot read", "directory")
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    fails(capsys, [*serve, "--api-key-file", str(tmp_path / "binary")], "--api-key-file", "not UTF-8")
    fails(capsys, [*serve, "--api-key", "a", "--api-key-file", str(tmp_path / "key")], "give one of them")


def test_connection_flags(capsys, tmp_path, monkeypatch):
    """--request-timeout and --max-connections checked as parsed; --max-connections and a margin must fit
    the open-file limit: the soft limit is raised to fit when the hard one allows, else one line says what
    fits."""
    import resource

    missing = str(tmp_path / "missing")  # the command stops at the checkpoint, after the limit is fitted
    fails(capsys, ["serve", "--checkpoint", missing, "--request-timeout", "0"], "--request-timeout", "> 0")
    fails(capsys, ["serve", "--checkpoint", missing, "--max-connections", "0"], "--max-connections")
    raised = []
    monkeypatch.setattr(resource, "setrlimit", lambda kind, limits: raised.append(limits))
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (256, 4096))
    fails(capsys, ["serve", "--checkpoint", missing, "--max-connections", "1000"], "no such folder")
    assert raised == [(1128, 4096)]
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (256, 512))
    fails(
        capsys,
        ["serve", "--checkpoint", missing],
        "--max-connections 1024",
        "512 files at most (ulimit -Hn)",
        "at most --max-connections 384",
    )


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2GB") == 2 * 10**9 and parse_bytes("1000") == 1000
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes("0.1KB") == 100 and parse_bytes("1.5GB") == 1_500_000_000
    for bad in ("0", "-1GB", "ten", "5 parsecs"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    for part in ("0.5", "5.5", "0.1B", "0.1KiB"):  # not a whole number of bytes: refused, not rounded down
        with pytest.raises(ValueError, match="whole number of bytes"):
            parse_bytes(part)


def test_a_size_that_is_not_whole_bytes_is_refused_naming_the_flag(capsys, tmp_path):
    serve = ["serve", "--checkpoint", str(tmp_path / "missing")]  # refused before the checkpoint is read
    fails(capsys, [*serve, "--max-request-bytes", "0.5"], "--max-request-bytes: ", "whole number of bytes", "'0.5'")
    fails(capsys, [*serve, "--cache-memory", "5.5"], "--cache-memory: ", "whole number of bytes", "'5.5'")


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_finishes_the_running_request_and_exits_0(tmp_path, stop):
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(tmp_path)
    byte_tokenizer().save(tmp_path / "tokenizer.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3", "serve", "--checkpoint", str(tmp_path), "--port", "0", "--threads", "1"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        port = None
        deadline = time.time() + 120
        while port is None:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "k3 serve exited"
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(found.group(1)) if found else None
            assert time.time() < deadline
        assert "256 slots of 4,096 tokens" in line and "prefix cache on" in line and "eager steps" in line
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "Hi", "max_tokens": 300, "ignore_eos": True}),
            {"Content-Type": "application/json"},
        )
        time.sleep(0.5)  # it is decoding
        proc.send_signal(stop)
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 200 and body["usage"]["completion_tokens"] == 300
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
