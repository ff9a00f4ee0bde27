"""Chat client retries/backoff and concurrency (fake transport, injected sleep), Batch-API files, resumable runs."""

import asyncio
import json

import pytest

from diffusion_embedder.reasonaug.llm import (
    ChatClient,
    ClientConfig,
    LLMError,
    make_request,
    read_batch_outputs,
    read_jsonl,
    run_requests,
    run_with_regeneration,
    select_answer,
    write_batch_requests,
)


def completion(text: str) -> dict:
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    }


class ScriptedTransport:
    """Returns the scripted (status, headers, payload) answers in order; records what was posted."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = []

    async def post(self, url, headers, body):
        self.calls.append((url, headers, body))
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


class Sleeps:
    def __init__(self):
        self.delays = []

    async def __call__(self, delay):
        self.delays.append(delay)


def make_client(script, **cfg):
    transport, sleeps = ScriptedTransport(script), Sleeps()
    config = ClientConfig(base_url="http://llm.local/v1", api_key="k", model="m", **cfg)
    return ChatClient(config, transport=transport, sleep=sleeps), transport, sleeps


def test_retries_429_and_5xx_with_exponential_backoff():
    client, transport, sleeps = make_client(
        [(429, {}, {"error": "rate"}), (503, {}, "busy"), (500, {}, {}), (200, {}, completion("hi"))],
        backoff_base=0.5,
    )
    out = asyncio.run(client.complete({"messages": [{"role": "user", "content": "q"}]}))
    assert out["choices"][0]["message"]["content"] == "hi"
    assert sleeps.delays == [0.5, 1.0, 2.0]
    url, headers, body = transport.calls[0]
    assert url == "http://llm.local/v1/chat/completions"
    assert headers["Authorization"] == "Bearer k" and body["model"] == "m"


def test_retry_after_header_and_backoff_cap():
    client, _, sleeps = make_client(
        [(429, {"Retry-After": "7"}, {}), (502, {}, {}), (502, {}, {}), (200, {}, completion("ok"))],
        backoff_base=1.0,
        backoff_max=3.0,
    )
    asyncio.run(client.complete({"messages": []}))
    assert sleeps.delays == [7.0, 2.0, 3.0]


def test_transport_errors_are_retried_then_give_up():
    client, transport, sleeps = make_client([ConnectionError("reset")] * 3, max_retries=2)
    with pytest.raises(LLMError, match="transport error after 3 attempts"):
        asyncio.run(client.complete({"messages": []}))
    assert len(transport.calls) == 3 and sleeps.delays == [1.0, 2.0]


def test_non_retryable_status_and_exhausted_retries_raise():
    client, transport, sleeps = make_client([(400, {}, {"error": "bad request"})])
    with pytest.raises(LLMError, match="HTTP 400") as e:
        asyncio.run(client.complete({"messages": []}))
    assert e.value.status == 400 and sleeps.delays == [] and len(transport.calls) == 1
    client, transport, _ = make_client([(500, {}, {})] * 3, max_retries=2)
    with pytest.raises(LLMError, match="HTTP 500"):
        asyncio.run(client.complete({"messages": []}))
    assert len(transport.calls) == 3


def test_concurrency_limit():
    class SlowTransport:
        active = peak = 0

        async def post(self, url, headers, body):
            SlowTransport.active += 1
            SlowTransport.peak = max(SlowTransport.peak, SlowTransport.active)
            await asyncio.sleep(0.001)
            SlowTransport.active -= 1
            return 200, {}, completion(body["messages"][0]["content"])

    client = ChatClient(ClientConfig(concurrency=3), transport=SlowTransport())

    async def many():
        return await asyncio.gather(*(client.complete({"messages": [{"content": str(i)}]}) for i in range(20)))

    outs = asyncio.run(many())
    assert [o["choices"][0]["message"]["content"] for o in outs] == [str(i) for i in range(20)]
    assert SlowTransport.peak == 3
    # the same client serves the next stage, which runs in a new event loop
    SlowTransport.peak = 0
    assert len(asyncio.run(many())) == 20 and SlowTransport.peak == 3


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:8000/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("REASONAUG_MODEL", "qwen")
    monkeypatch.setenv("REASONAUG_CONCURRENCY", "4")
    cfg = ClientConfig.from_env(model=None)
    assert (cfg.base_url, cfg.api_key, cfg.model, cfg.concurrency) == ("http://localhost:8000/v1", "sk-test", "qwen", 4)
    assert ClientConfig.from_env(model="other").model == "other"


def test_batch_files_round_trip_and_errors(tmp_path):
    reqs = [make_request(f"request-{i}", [{"role": "user", "content": f"q{i}"}], "m", 10) for i in range(3)]
    write_batch_requests(tmp_path / "in.jsonl", reqs)
    assert [r for _, r in read_jsonl(tmp_path / "in.jsonl")] == reqs
    assert reqs[0] == {
        "custom_id": "request-0",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "q0"}], "max_tokens": 10},
    }
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(reqs[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        read_jsonl(bad)
    out = tmp_path / "out.jsonl"
    out.write_text(
        json.dumps({"custom_id": "a", "response": {"status_code": 200, "body": completion("x")}, "error": None})
        + "\n"
        + json.dumps({"custom_id": "b", "response": {"status_code": 500, "body": {}}, "error": {"message": "e"}})
        + "\n"
    )
    res = read_batch_outputs(out)
    assert res["a"].content == "x" and res["a"].finish_reason == "stop"
    assert res["b"].content is None and res["b"].status_code == 500


class EchoClient:
    """Fake OpenAI client: the answer is a function of the request body; counts calls per body."""

    def __init__(self, fail_after=None, answer=None):
        self.bodies = []
        self.fail_after = fail_after
        self.answer = answer or (lambda body: "answer to " + body["messages"][-1]["content"])

    async def complete(self, body):
        await asyncio.sleep(0)
        if self.fail_after is not None and len(self.bodies) >= self.fail_after:
            raise RuntimeError("interrupted")
        self.bodies.append(json.dumps(body, sort_keys=True))
        return completion(self.answer(body))


def _requests(n):
    return [make_request(f"r{i}", [{"role": "user", "content": f"q{i}"}], "m", 5) for i in range(n)]


def test_run_requests_resumes_without_resending(tmp_path):
    out = tmp_path / "out.jsonl"
    first = EchoClient(fail_after=4)
    with pytest.raises(RuntimeError, match="interrupted"):
        run_requests(first, _requests(10), out)
    assert len(read_batch_outputs(out)) == 4
    second = EchoClient()
    report = run_requests(second, _requests(10), out)
    assert report.skipped == 4 and report.sent == 6
    assert not set(first.bodies) & set(second.bodies)
    outputs = read_batch_outputs(out)
    assert {k: v.content for k, v in outputs.items()} == {f"r{i}": f"answer to q{i}" for i in range(10)}
    assert run_requests(EchoClient(), _requests(10), out).sent == 0


def test_a_failed_line_of_a_downloaded_batch_output_is_sent_again(tmp_path):
    """The CLI tells a user whose Batch-API output holds failed lines to rerun without --batch: that rerun skipped
    them as done, sent nothing, reported no failure, and the items were dropped."""
    out = tmp_path / "out.jsonl"
    run_requests(EchoClient(), _requests(3), out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    lines[1] = {"id": "b1", "custom_id": "r1", "response": None, "error": {"code": "batch_expired", "message": "x"}}
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_batch_outputs(out)["r1"].content is None
    client = EchoClient()
    report = run_requests(client, _requests(3), out)
    assert report.sent == 1 and report.skipped == 2 and len(client.bodies) == 1
    assert {k: v.content for k, v in read_batch_outputs(out).items()} == {f"r{i}": f"answer to q{i}" for i in range(3)}


def test_truncated_last_line_is_repaired(tmp_path):
    out = tmp_path / "out.jsonl"
    run_requests(EchoClient(), _requests(2), out)
    with open(out, "a") as f:
        f.write('{"custom_id": "r2", "respo')  # a run killed mid-write
    client = EchoClient()
    run_requests(client, _requests(3), out)
    assert len(client.bodies) == 1
    assert {k: v.content for k, v in read_batch_outputs(out).items()}["r2"] == "answer to q2"


def test_failed_requests_are_left_for_the_next_run(tmp_path):
    class Flaky(EchoClient):
        async def complete(self, body):
            if body["messages"][0]["content"] == "q1":
                raise LLMError("HTTP 400", 400)
            return await super().complete(body)

    out = tmp_path / "out.jsonl"
    report = run_requests(Flaky(), _requests(3), out)
    assert report.failed == ["r1"] and report.sent == 2
    assert set(read_batch_outputs(out)) == {"r0", "r2"}
    assert run_requests(EchoClient(), _requests(3), out).sent == 1


def test_malformed_answers_are_regenerated_with_a_new_seed(tmp_path):
    # q0 is answered well at once, q1 only on its 2nd regeneration, q2 never
    good_at = {"q0": 0, "q1": 2, "q2": 99}

    def answer(body):
        q = body["messages"][-1]["content"]
        return "GOOD" if body.get("seed", 0) >= good_at[q] else "bad"

    out = tmp_path / "out.jsonl"
    client = EchoClient(answer=answer)
    valid = lambda text: text == "GOOD"  # noqa: E731
    report = run_with_regeneration(client, _requests(3), out, valid, max_regenerations=2)
    assert report.sent == 3 + 2 + 2  # base, retry1 for q1 and q2, retry2 for q1 and q2
    outputs = read_batch_outputs(out)
    assert sorted(outputs) == ["r0", "r1", "r1#retry1", "r1#retry2", "r2", "r2#retry1", "r2#retry2"]
    assert [select_answer(outputs, f"r{i}", valid, 2) for i in range(3)] == ["GOOD", "GOOD", None]
    assert len(set(client.bodies)) == len(client.bodies)
    again = EchoClient(answer=answer)
    assert run_with_regeneration(again, _requests(3), out, valid, max_regenerations=2).sent == 0


def test_urllib_transport_against_a_local_server():
    """The real stdlib transport, end to end, against an OpenAI-shaped server on localhost."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Authorization"], body))
            if len(seen) == 1:
                self.send_response(429)
                self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(b'{"error": "slow down"}')
                return
            payload = json.dumps(completion("pong " + body["messages"][0]["content"])).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sleeps = Sleeps()
        config = ClientConfig(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="k", model="m")
        client = ChatClient(config, sleep=sleeps)
        out = asyncio.run(client.complete({"messages": [{"role": "user", "content": "ping"}]}))
    finally:
        server.shutdown()
        server.server_close()
    assert out["choices"][0]["message"]["content"] == "pong ping"
    assert [s[0] for s in seen] == ["/v1/chat/completions"] * 2 and seen[0][1] == "Bearer k"
    assert sleeps.delays == [1.0]
