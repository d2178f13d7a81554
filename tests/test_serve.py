"""``mla-fuser serve`` end to end: the command runs as a subprocess on a free 127.0.0.1 port with the embedded default
(fp32, CPU), the real ``openai`` client talks to it, and every answer's text and token count equal the model's own
greedy ``generate()`` for the same prompt (a fused copy of the same seeded preset, built here).  Traffic goes only to
127.0.0.1; every client call has a timeout and every wait a deadline."""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from mla_fuser import compat
from mla_fuser.cli import main
from mla_fuser.serve import INSTALL_HINT, MIN_VERSION, missing_packages

MODEL = "deepseek-v2-lite-tiny"
MISSING = missing_packages()
SUPPORTED = compat.transformers_version() >= MIN_VERSION
needs_server = pytest.mark.skipif(
    bool(MISSING) or not SUPPORTED,
    reason=(f"serving dependencies missing ({', '.join(MISSING)}): {INSTALL_HINT}" if MISSING else
            f"serve needs transformers>={'.'.join(map(str, MIN_VERSION))}"))
CALL_TIMEOUT = 60  # seconds, any one HTTP call
# a stream's usage chunk, as the OpenAI API has clients ask for it (Transformers sends it only then from 5.25; before,
# it ignored the field and always sent it)
USAGE = {"include_usage": True}
START_TIMEOUT = 90  # seconds, the server's start (import, build, fuse) on a busy 2-core machine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _requests_logged(log: str) -> int:
    """How many requests the server's handlers have logged: Transformers' ``[Request received]`` warning up to 5.24,
    its ``Request <id>: model ...`` line from 5.25 (which serve turns on)."""
    return log.count("[Request received]") + len(re.findall(r"(?m)Request \S+: model ", log))


def _get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.status, json.loads(response.read())


def _post_raw(port, path, data: bytes):
    """(status, JSON body) of a POST whose body is sent as given (to send broken JSON)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Server:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", timeout=CALL_TIMEOUT,
                             max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes share the CI machine's cores
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "mla_fuser.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--dtype", "fp32", "--timeout-graceful-shutdown", "5",
                                 "--switch-interval", "0.001"],
                                stdout=fh, stderr=subprocess.STDOUT, env=env)
    srv = Server(proc, port, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{srv.log_text()}"
            try:
                if _get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no server after {START_TIMEOUT} s:\n{srv.log_text()}"
            time.sleep(0.25)
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference():
    """The served model's twin: the same seeded preset, fused, with the preset's tokenizer."""
    from mla_fuser.presets import build_preset, preset_tokenizer, use_tokenizer_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_preset(MODEL)
    tokenizer = preset_tokenizer(MODEL)
    use_tokenizer_ids(model, tokenizer)
    yield model, tokenizer
    torch.set_num_threads(threads)


def _expected(reference, ids, max_tokens):
    """(text, completion tokens, finish reason) of the model's own greedy generate() (tokens up to EOS included)."""
    model, tokenizer = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = tokenizer.eos_token_id
    if eos in new:
        new = new[:new.index(eos) + 1]
    return tokenizer.decode(new, skip_special_tokens=True), len(new), "stop" if new[-1] == eos else "length"


def _completion_ids(reference, prompt):
    return reference[1](prompt)["input_ids"]


def _chat_ids(reference, messages):
    return reference[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]


def _complete(client, prompt, max_tokens, stream=False, **kw):
    """(text, completion tokens, finish reason) of one /v1/completions call."""
    if not stream:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
        return out.choices[0].text, out.usage.completion_tokens, out.choices[0].finish_reason
    text, usage, finish = "", None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options=USAGE, **kw):
        if chunk.choices:  # (the usage chunk has none, as the OpenAI API sends it)
            text += chunk.choices[0].text or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return text, usage.completion_tokens, finish


def _chat(client, messages, max_tokens, stream=False):
    """(text, completion tokens, finish reason) of one /v1/chat/completions call."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
        return out.choices[0].message.content, out.usage.completion_tokens, out.choices[0].finish_reason
    text, usage, finish = "", None, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options=USAGE):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return text, usage.completion_tokens, finish


@needs_server
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_completion_equals_generate(server, reference, stream):
    prompt = "The quick brown fox jumps over"
    got = _complete(server.client(), prompt, 12, stream=stream)
    assert got == _expected(reference, _completion_ids(reference, prompt), 12)


@needs_server
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_completion_equals_generate(server, reference, stream):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Once upon a time"}]
    got = _chat(server.client(), messages, 10, stream=stream)
    assert got == _expected(reference, _chat_ids(reference, messages), 10)


@needs_server
def test_the_server_serves_under_the_switch_interval_asked(server):
    assert "GIL switch interval 1 ms" in server.log_text()


def test_switch_interval_is_set_for_the_block_and_restored():
    import sys

    from mla_fuser.serve import SWITCH_INTERVAL_S, switch_interval

    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError):
        with switch_interval(SWITCH_INTERVAL_S):
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
            raise RuntimeError("the server stopped")
    assert sys.getswitchinterval() == before


@needs_server
def test_models_lists_the_served_model(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]


@needs_server
def test_sixteen_concurrent_requests_of_mixed_lengths(server, reference):
    """Prompts of 2 to ~200 tokens and 1 to 24 new tokens, chat and completion, streamed or not, all in flight at
    once: each answer equals its own one-request generate()."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    jobs = []
    for i in range(16):
        text = " ".join(words[(i + j) % len(words)] for j in range(1 + (i * 13) % 70))
        max_tokens = 1 + (i * 7) % 24
        if i % 2:
            messages = [{"role": "user", "content": text}]
            jobs.append(("chat", messages, max_tokens, i % 4 == 1, _chat_ids(reference, messages)))
        else:
            jobs.append(("completion", text, max_tokens, i % 4 == 0, _completion_ids(reference, text)))
    expected = [_expected(reference, ids, n) for _, _, n, _, ids in jobs]
    client = server.client()

    def send(job):
        kind, payload, n, stream, _ = job
        return (_chat if kind == "chat" else _complete)(client, payload, n, stream=stream)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, jobs, timeout=2 * CALL_TIMEOUT))
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got == want, f"request {i} ({jobs[i][0]}, {len(jobs[i][4])} prompt tokens, max_tokens {jobs[i][2]})"


@needs_server
def test_bad_requests_fail_alone_with_4xx(server, reference):
    import openai

    client = server.client()
    prompt = "a request beside the bad ones"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(_complete, client, prompt, 16, True)
        with pytest.raises(openai.BadRequestError, match="pinned"):
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="context is 4096 tokens"):
            client.completions.create(model=MODEL, prompt="ab " * 5000, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="context is 4096 tokens"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ab " * 5000}])
        for bad in (0, -3):
            with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer"):
                client.completions.create(model=MODEL, prompt="hi", max_tokens=bad)
            with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer"):
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=bad)
        status, body = _post_raw(server.port, "/v1/chat/completions", b'{"model": "x", "messages": [')
        assert status == 422 and "JSON decode error" in body["error"]["message"]
        assert good.result(timeout=CALL_TIMEOUT) == _expected(reference, _completion_ids(reference, prompt), 16)
    assert _get(server.port, "/health") == (200, {"status": "ok"})


@needs_server
def test_new_tokens_are_capped_at_what_the_context_holds(server, reference):
    """A prompt near the end of the context asking for more new tokens than fit gets those that fit (finish reason
    ``length``), the model's own generate() for that many, never positions past the context."""
    prompt = "ab " * 3900
    ids = _completion_ids(reference, prompt)
    room = 4096 - len(ids)
    out = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=room + 300, temperature=0)
    got = (out.choices[0].text, out.usage.completion_tokens, out.choices[0].finish_reason)
    assert got == _expected(reference, ids, room)
    assert out.usage.prompt_tokens == len(ids) and got[1:] == (room, "length")


@needs_server
def test_client_disconnect_cancels_its_request(server, reference):
    """A stream closed after three chunks is cancelled in the engine (logged with its request id); a request
    streaming beside it is untouched."""
    client = server.client()
    prompt = "still streaming"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=3000, stream=True,
                                           extra_headers={"X-Request-ID": "leaves-early"})
        other = pool.submit(_complete, client, prompt, 20, True)
        for _, _ in zip(range(3), stream):
            pass
        stream.close()
        assert other.result(timeout=CALL_TIMEOUT) == _expected(reference, _completion_ids(reference, prompt), 20)
    deadline = time.monotonic() + 15
    while "request leaves-early cancelled" not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()[-3000:]
        time.sleep(0.2)


@needs_server
def test_json_client_that_leaves_cancels_its_request(server, reference):
    """A non-streaming request whose client hangs up before the answer is cancelled in the engine (logged with its
    request id, ``CancelOnDisconnect``) instead of generating its 3000 tokens for nobody; a request beside it gets
    its right answer."""
    prompt = "beside it"
    body = json.dumps({"model": MODEL, "prompt": "nobody waits", "max_tokens": 3000, "temperature": 0}).encode()
    received = _requests_logged(server.log_text())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with socket.create_connection(("127.0.0.1", server.port), timeout=CALL_TIMEOUT) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"X-Request-ID: json-leaves-early\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\n\r\n" + body)
            deadline = time.monotonic() + CALL_TIMEOUT
            while _requests_logged(server.log_text()) == received:  # the handler has it
                assert time.monotonic() < deadline, server.log_text()[-3000:]
                time.sleep(0.1)
            other = pool.submit(_complete, server.client(), prompt, 20)
        # (the connection is closed here, with no answer read)
        assert other.result(timeout=CALL_TIMEOUT) == _expected(reference, _completion_ids(reference, prompt), 20)
    deadline = time.monotonic() + 15
    while "request json-leaves-early cancelled" not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()[-3000:]
        time.sleep(0.2)


@needs_server
def test_sigterm_finishes_or_cancels_and_exits_0(server, reference):
    """Last (it stops the module's server): SIGTERM with two requests in flight; the short one finishes with its
    right answer, the long one is cut at the 5 s shutdown deadline, and the process exits 0."""
    client = server.client()
    prompt = "finish me"
    flowing = {"long": threading.Event(), "short": threading.Event()}

    def stream(name, prompt, max_tokens):
        """(text, finish reason) of a stream that sets its event at its first chunk; text so far if it is cut."""
        text, finish = "", None
        try:
            for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True):
                flowing[name].set()
                text += chunk.choices[0].text or ""
                finish = chunk.choices[0].finish_reason or finish
        except Exception:  # the server closes a stream it cancels at its deadline
            finish = "cut"
        return text, finish

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        cut = pool.submit(stream, "long", "long", 3000)
        assert flowing["long"].wait(CALL_TIMEOUT)
        short = pool.submit(stream, "short", prompt, 24)
        assert flowing["short"].wait(CALL_TIMEOUT)
        server.proc.send_signal(signal.SIGTERM)
        text, _, finish = _expected(reference, _completion_ids(reference, prompt), 24)
        assert short.result(timeout=CALL_TIMEOUT) == (text, finish)
        assert cut.result(timeout=CALL_TIMEOUT)[1] != "length"  # cut before its 3000 tokens
    assert server.proc.wait(timeout=30) == 0, server.log_text()[-3000:]
    assert "Finished server process" in server.log_text()


def test_refused_below_the_supported_transformers(capsys):
    if SUPPORTED:
        pytest.skip("this Transformers can serve")
    with pytest.raises(SystemExit) as exc:
        main(["serve"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "serve needs transformers>=" in err


@pytest.mark.skipif(compat.transformers_version() < compat.SERVE_REBUILT,
                    reason="the engine-process server is that of transformers>=5.25")
def test_the_rebuilt_server_of_5_25_is_served_through_our_loader():
    """5.25's server (a spawned engine process per model) is driven, not refused: the engine loads our model with a
    pickled copy of the loader, which must survive the trip and load nothing but our model."""
    import pickle

    from mla_fuser import serve
    from mla_fuser.serve.engine import MODEL_ARGS, FusedModelLoader

    assert serve.unsupported() is None and compat.serving_in_engine_processes()
    args = {"model": None, "preset": MODEL, "dtype": "fp32", "device": None, "seed": 0}
    loader = pickle.loads(pickle.dumps(FusedModelLoader(MODEL, {k: args[k] for k in MODEL_ARGS}, 0.001)))
    config, generation_config = loader.load_config(f"{MODEL}@main")
    tokenizer = loader.load_processor(f"{MODEL}@main")
    assert config.max_position_embeddings == 4096 and generation_config.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="serves 'deepseek-v2-lite-tiny' only"):
        loader.load_config("another/model@main")


def test_missing_dependencies_say_what_to_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(["serve"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mla-fuser: error: serve needs the server dependencies (missing: fastapi): {INSTALL_HINT}"


# ---- the command line: usage errors exit 2 with one line, before any model is built ---------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    """A saved checkpoint directory of the tiny default: config and weights; tokenizer files only if asked."""
    from mla_fuser.presets import build_preset

    build_preset(MODEL, fuse=False, attn_implementation="sdpa").save_pretrained(tmp_path)
    return tmp_path


def _usage_error(capsys, monkeypatch, argv) -> str:
    import mla_fuser.presets

    monkeypatch.setattr(mla_fuser.presets, "build_preset", lambda *a, **k: pytest.fail("a model was built"))
    capsys.readouterr()  # (what fixtures printed)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mla-fuser: error: ") and err.count("\n") == 1, err
    return err


@needs_server
@pytest.mark.parametrize("argv, expected", [
    (["serve", "/nonexistent"], "/nonexistent: no such directory"),
    (["serve", "--port", "0"], "argument --port: expected a TCP port from 1 to 65535"),
    (["serve", "--cb-max-memory-percent", "1.5"], "argument --cb-max-memory-percent: expected a number in (0, 1]"),
    (["serve", "--cb-num-blocks", "0"], "argument --cb-num-blocks: expected a positive integer"),
    (["serve", "--timeout-graceful-shutdown", "-1"], "expected seconds"),
    (["serve", "--cb-max-requests-per-batch", "0"],
     "argument --cb-max-requests-per-batch: expected a positive integer"),
    (["serve", "--switch-interval", "0"], "argument --switch-interval: expected seconds in (0, 1]"),
    (["serve", "--switch-interval", "soon"], "argument --switch-interval: expected seconds in (0, 1]"),
])
def test_serve_usage_errors(capsys, monkeypatch, argv, expected):
    assert expected in _usage_error(capsys, monkeypatch, argv)


@needs_server
def test_serve_usage_errors_about_the_model_and_the_address(capsys, monkeypatch, checkpoint):
    err = _usage_error(capsys, monkeypatch, ["serve", str(checkpoint), "--preset", "deepseek-v3-tiny"])
    assert "serve takes one model: MODEL_DIR, --model DIR or --preset NAME" in err
    assert "no tokenizer files" in _usage_error(capsys, monkeypatch, ["serve", str(checkpoint)])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        err = _usage_error(capsys, monkeypatch, ["serve", "--host", "127.0.0.1", "--port", str(busy.getsockname()[1])])
    assert "cannot listen on 127.0.0.1:" in err


@needs_server
def test_cb_options_reach_the_engine_config_or_fail_by_name(capsys, monkeypatch):
    import argparse
    import dataclasses

    import transformers

    from mla_fuser.serve import cb_config

    args = argparse.Namespace(cb_max_requests_per_batch=256, cb_max_batch_tokens=2048)
    if "max_requests_per_batch" in transformers.ContinuousBatchingConfig.__dataclass_fields__:
        config = cb_config(args)
        assert (config.max_requests_per_batch, config.max_batch_tokens) == (256, 2048)

    @dataclasses.dataclass
    class OlderConfig:  # an engine config without the field
        max_batch_tokens: int | None = None

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", OlderConfig)
    err = _usage_error(capsys, monkeypatch, ["serve", "--cb-max-requests-per-batch", "256"])
    assert ("--cb-max-requests-per-batch needs a Transformers whose ContinuousBatchingConfig has "
            "max_requests_per_batch") in err


@needs_server
def test_checkpoint_loads_fused_with_its_own_tokenizer(checkpoint):
    """``serve MODEL_DIR``'s loading: the package's loader (fused) and the checkpoint's tokenizer."""
    import argparse

    from mla_fuser.presets import preset_tokenizer
    from mla_fuser.serve import load_served_model

    preset_tokenizer(MODEL).save_pretrained(checkpoint)
    args = argparse.Namespace(model=str(checkpoint), preset=MODEL, dtype="float32", device=None, seed=0)
    model, tokenizer, name = load_served_model(args)
    assert name == str(checkpoint) and len(tokenizer) == model.config.vocab_size
    assert model.fusion_report.rows and all(r.status == "fused" for r in model.fusion_report.rows if r.fuser == "mla")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True) == "<|bos|><|user|>hi<|eos|><|assistant|>"


@needs_server
@pytest.mark.skipif(compat.transformers_version() < compat.SERVE_REBUILT,
                    reason="the engine-process loader is for transformers>=5.25")
def test_engine_loader_loads_a_checkpoint_fused_with_its_own_tokenizer(checkpoint, capsys):
    """``serve MODEL_DIR``'s loading on 5.25, as the engine process runs it (a pickled copy of the loader): the
    package's loader (fused), the checkpoint's tokenizer, and the generation config the API server reads."""
    import pickle

    from transformers.cli.serving.utils import canonical_model_id

    from mla_fuser.presets import preset_tokenizer
    from mla_fuser.serve.engine import FusedModelLoader

    preset_tokenizer(MODEL).save_pretrained(checkpoint)
    name = str(checkpoint)
    args = {"model": name, "preset": MODEL, "dtype": "float32", "device": None, "seed": 0}
    loader = pickle.loads(pickle.dumps(FusedModelLoader(name, args)))
    model, tokenizer = loader.load_model_and_processor(canonical_model_id(name))
    assert len(tokenizer) == model.config.vocab_size
    assert model.fusion_report.rows and all(r.status == "fused" for r in model.fusion_report.rows if r.fuser == "mla")
    assert loader.load_config(name)[1].eos_token_id == model.generation_config.eos_token_id
    assert f"model: {name}" in capsys.readouterr().out

