"""Errors over HTTP: the API key, malformed and invalid requests, oversized bodies, infeasible requests.
Every error is an OpenAI error object and none is a 500."""

from __future__ import annotations

import socket

import httpx
import pytest


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# -- the API key -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path",
                         [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                          ("POST", "/v1/chat/completions"), ("GET", "/openapi.json")])
@pytest.mark.parametrize("headers",
                         [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic e2e-secret-key"},
                          {"Authorization": "Bearer"}])
def test_missing_or_wrong_api_key_is_401(server, method, path, headers):
    body = {"prompt": "hi", "max_tokens": 1} if method == "POST" else None
    response = httpx.request(method, server.url + path, headers=headers, json=body, timeout=10)
    error = assert_error(response, 401, code="invalid_api_key")
    assert "API key" in error["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/health"])
def test_two_authorization_headers_are_a_400_even_if_both_hold_the_key(server, path):
    """A proxy that checks the first and a server that reads the last would disagree on the caller."""
    key = f"Bearer {server.api_key}"
    body = {"prompt": "hi", "max_tokens": 1} if path == "/v1/completions" else None
    response = httpx.request("POST" if body else "GET", server.url + path, json=body, timeout=10,
                             headers=[("Authorization", key), ("authorization", key)])
    error = assert_error(response, 400, code="duplicate_authorization_header")
    assert "2 Authorization headers" in error["message"]


def test_health_needs_no_key_and_the_right_key_works(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).status_code == 200
    lower = {"authorization": f"bearer {server.api_key}"}
    assert httpx.get(f"{server.url}/v1/models", headers=lower, timeout=10).status_code == 200


# -- malformed and invalid requests ----------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content", [b"{not json", b'{"prompt": "x",}', b"\xff\xfe\x00", b"[" * 5000, b"null",
                                     b'"just a string"', b"[1, 2]", b"NaN"])
def test_malformed_bodies_are_400(server, path, content):
    response = httpx.post(server.url + path, content=content, timeout=10,
                          headers={**server.headers, "Content-Type": "application/json"})
    assert_error(response, 400)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": 42}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "x", "unknown_field": 1}, "unknown_field"),
    ({"prompt": "x", "use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"prompt": "x", "use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"prompt": "x", "use_beam_search": True, "top_k": 5}, "top_k"),
    ({"prompt": "x", "use_beam_search": True, "n": 5, "beam_width": 4}, "n"),
    ({"prompt": "x", "use_beam_search": True, "beam_width": 64}, "beam_width"),
    ({"prompt": "x", "use_beam_search": True, "best_of": 64}, "best_of"),
    ({"prompt": "x", "use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"prompt": "x", "beam_width": 4}, "beam_width"),
    ({"prompt": "x", "length_penalty": 2.0}, "length_penalty"),
    ({"prompt": "x", "n": 4, "best_of": 2}, "best_of"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "x", "min_tokens": 10, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": 1e-300, "temperature": 0.8}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty"),
])
def test_invalid_completion_fields_are_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=30)
    assert_error(response, 400, param=param)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
])
def test_invalid_chat_fields_are_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=30)
    assert_error(response, 400, param=param)


def test_unknown_model_is_404(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-4", "prompt": "x"},
                          headers=server.headers, timeout=10)
    assert_error(response, 404, param="model", code="model_not_found")


def test_unknown_path_and_method_use_the_error_shape(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing", headers=server.headers, timeout=10), 404)
    assert_error(httpx.delete(f"{server.url}/v1/models", headers=server.headers, timeout=10), 405)


# -- oversized bodies ------------------------------------------------------------------------------
def test_oversized_body_is_413(server):
    body = b'{"prompt": "' + b"a" * (2 * 2**20) + b'"}'
    headers = {**server.headers, "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=30)
    assert_error(response, 413, code="request_too_large")

    def chunks():  # no Content-Length: the server must count the bytes it reads
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=headers, timeout=30)
    assert "content-length" not in response.request.headers
    assert_error(response, 413, code="request_too_large")
    # just under the limit is accepted (and then judged on its content)
    small = b'{"prompt": "hello", "max_tokens": 2, "temperature": 0}'
    assert httpx.post(f"{server.url}/v1/completions", content=small, headers=headers,
                      timeout=30).status_code == 200


def test_declared_length_over_the_limit_is_413_before_the_body_is_read(server):
    """A raw request that declares 5 MiB and sends two bytes: the header alone decides."""
    request = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
               f"{server.api_key}\r\nContent-Type: application/json\r\nContent-Length: "
               f"{5 * 2**20}\r\n\r\n{{}}").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        head = sock.recv(65536).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head


# -- infeasible requests ---------------------------------------------------------------------------
def test_infeasible_request_gets_the_engines_message(small_server, tiny_chat_model_dir):
    """The 400 carries exactly the message `RequestTooLargeError` has in-process on the same engine sizing."""
    from widebeam.engine import LLMEngine
    from widebeam.errors import RequestTooLargeError
    from widebeam.params import BeamSearchParams

    prompt = "An infeasible beam search"
    response = httpx.post(f"{small_server.url}/v1/completions", timeout=30,
                          json={"prompt": prompt, "max_tokens": 40, "use_beam_search": True,
                                "beam_width": 16})
    error = assert_error(response, 400, code="kv_cache_capacity_exceeded")
    assert error["type"] == "invalid_request_error"

    engine = LLMEngine(str(tiny_chat_model_dir), device="cpu", **small_server.engine_options)
    with pytest.raises(RequestTooLargeError) as info:
        engine.add_request("r", prompt, BeamSearchParams(beam_width=16, max_new_tokens=40))
    assert error["message"] == str(info.value)
    assert "never fit" in error["message"] and "beam_width=16" in error["message"]
