import contextlib
import http.server
import json
import logging
import threading
import time

import pytest

from mmgrpo_jax.engines.http_json import ServerError
from mmgrpo_jax.engines.openai_lm import OpenAICompatibleLM

KEY = "sk-test-secret-0123456789"


class ChatServer(http.server.ThreadingHTTPServer):
    """A chat-completions server on 127.0.0.1 answering from a script of behaviours."""

    def __init__(self, script):
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.script, self.requests = list(script), []

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.server_port}/v1"


class ChatHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), body))
        action = self.server.script.pop(0) if self.server.script else "ok"
        if action == "slow":
            time.sleep(1.0)
        if action == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        if action == "400":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"bad model name")
            return
        reply = {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "content": f"echo {body['messages'][-1]['content']}",
                    },
                    "finish_reason": "length" if body.get("max_tokens") == 1 else "stop",
                }
            ]
        }
        payload = json.dumps(reply).encode()
        if action == "malformed":
            payload = b'{"choices": []}'
        if action == "not json":
            payload = b"<html>gateway</html>"
        self.send_response(200)
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the client timed out and left
            self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve(monkeypatch):
    monkeypatch.setenv("TEST_LM_KEY", KEY)
    servers = []

    def start(*script):
        server = ChatServer(script)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def client(server, **kwargs):
    options = {"api_key_env": "TEST_LM_KEY", "timeout_s": 0.5, "max_retries": 2, "backoff_s": 0.01}
    return OpenAICompatibleLM(server.base_url, "tiny-model", **{**options, **kwargs})


def test_success_sends_model_messages_settings_and_the_key(serve):
    server = serve("ok")
    out = client(server, temperature=0.0)([{"role": "user", "content": "hi"}], max_new_tokens=1)
    assert out.text == "echo hi" and out.finish_reason == "length"
    path, headers, body = server.requests[0]
    assert path == "/v1/chat/completions"
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert body == {
        "model": "tiny-model",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.0,
        "max_tokens": 1,
    }


@pytest.mark.parametrize("failure", ["slow", "500"])
def test_a_timeout_or_a_500_is_retried(serve, failure, caplog):
    server = serve(failure, "ok")
    with caplog.at_level(logging.DEBUG):
        assert client(server)([{"role": "user", "content": "x"}]).text == "echo x"
    assert len(server.requests) == 2
    assert "retry 1/2" in caplog.text and KEY not in caplog.text


def test_retries_run_out_with_the_last_error_named(serve, caplog):
    server = serve("500", "500", "500")
    with caplog.at_level(logging.DEBUG), pytest.raises(ServerError, match=r"3 attempts.*HTTP 500"):
        client(server)([{"role": "user", "content": "x"}])
    assert KEY not in caplog.text


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ("malformed", "no choices\\[0\\].message.content"),
        ("not json", "not JSON"),
        ("400", "HTTP 400: bad model"),
    ],
)
def test_unusable_replies_are_clear_errors_not_retried(serve, action, message):
    server = serve(action)
    with pytest.raises(ServerError, match=message) as err:
        client(server)([{"role": "user", "content": "x"}])
    assert len(server.requests) == 1 and KEY not in str(err.value)


def test_missing_key_and_bad_arguments_are_named(serve, monkeypatch):
    server = serve()
    monkeypatch.delenv("TEST_LM_KEY")
    with pytest.raises(RuntimeError, match="TEST_LM_KEY"):
        client(server)([{"role": "user", "content": "x"}])
    assert KEY not in repr(client(server))
    with pytest.raises(TypeError, match="unknown sampling arguments \\['top_q'\\]"):
        client(server)([{"role": "user", "content": "x"}], top_q=0.5)
    assert (
        OpenAICompatibleLM(server.base_url, "m", api_key_env=None)(
            [{"role": "user", "content": "x"}]
        ).text
        == "echo x"
    )
