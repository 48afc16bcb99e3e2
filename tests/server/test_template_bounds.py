"""A server that trusts request-sent chat templates bounds them (issue #24).

With ``--trust-request-chat-template`` the issue's probes (nested loops, string repetition) and
a template over ``--max-chat-template-bytes`` are 400s naming the field, answered within the
render timeout, while ``/health`` keeps answering at once; a plain template still renders.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from attnserve.entrypoints.openai.protocol import ServerLimits
from tests.server.conftest import API_KEY, ENGINE_KWARGS, MODEL_NAME, ServerThread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]
LIMITS = ServerLimits(trust_request_chat_template=True, max_chat_template_bytes=4096, chat_template_timeout_s=0.5,
                      max_chat_template_output_chars=1 << 20)


@pytest.fixture(scope="module")
def trusting_server(model_dir):
    srv = ServerThread(model_dir, app_kwargs={"limits": LIMITS}, **ENGINE_KWARGS)
    yield srv
    srv.stop()


def test_request_templates_are_bounded(trusting_server):
    url = trusting_server.base_url
    probes = [  # (field, template, what the message names)
        # loops that write nothing: only the time bound stops them, whatever the machine's speed
        # (with output, the output cap would fire first on a fast one)
        ("chat_template_kwargs", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                 "{% endfor %}", "0.5 s"),
        ("chat_template", "{{ 'x' * 10**9 }}", "larger than the bound"),
        ("chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}" + " " * 5000, "4096"),
    ]
    results: list = []

    def send():
        for field, template, _ in probes:
            extra = {"chat_template_kwargs": {"chat_template": template}} if field == "chat_template_kwargs" \
                else {"chat_template": template}
            start = time.perf_counter()
            resp = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=30,
                              json={"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, **extra})
            results.append((resp, time.perf_counter() - start))

    t = threading.Thread(target=send)
    t.start()
    worst = 0.0
    while t.is_alive():
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - start)
        time.sleep(0.02)
    t.join()
    assert worst < 1.0, f"/health took {worst:.2f} s while a template rendered"
    for (field, _, says), (resp, seconds) in zip(probes, results, strict=True):
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == field and says in err["message"], err
        assert seconds < 2.0, f"{field}: answered after {seconds:.2f} s"
    ok = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=30,
                    json={"model": MODEL_NAME, "messages": MSG, "max_tokens": 2,
                          "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert ok.status_code == 200, ok.text
    trusting_server.wait_idle()


def test_server_limits_are_checked():
    for bad in ({"max_chat_template_bytes": 0}, {"chat_template_timeout_s": -1},
                {"chat_template_timeout_s": float("inf")}, {"max_chat_template_output_chars": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerLimits(**bad)
