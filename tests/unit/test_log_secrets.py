"""No credential in any log, #25 item 15: every setting typed ``engine.secrecy.Secret`` is masked in
the JSON logs because of its type (tokens, signing secrets, notification URLs, routing keys), reprs
withhold them, and the HTTP client libraries (httpx, urllib3) log no request URL path at any level,
in either log format."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine import logformat, secrecy
from engine.serve.config import ServeConfig, load_config
from engine.serve.notify import Notification, Notifier

SLACK = "https://hooks.slack.com/services/T0ABCDEF/B0GHIJKL/s3cr3tW3bh00kPathXYZ"
SECRETS = {
    "RUNBOOK_WEBHOOK_TOKEN": "sender-token-0123456789",
    "RUNBOOK_APPROVER_TOKEN_ALICE": "approver-token-0123456789",
    "RUNBOOK_READER_TOKEN_GRAFANA": "reader-token-0123456789",
    "RUNBOOK_NOTIFY_SECRET": "notify-signing-0123456789",
    "RUNBOOK_PAGERDUTY_SECRET": "pd-signing-secret-0123456789",
    "RUNBOOK_NOTIFY_URL": SLACK,
    "RUNBOOK_PAGERDUTY_ROUTING_KEY": "R0UT1NGK3Yabcdef0123456789abcdef",
}
FILE_SECRETS = {"auth.senders.pager": "pager-credential-9876543210"}


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logformat.JsonFormatter())  # no environment secrets: the type must do it
    root.handlers = [handler]
    root.setLevel(logging.DEBUG)
    yield stream
    root.handlers = handlers
    root.setLevel(level)


def _config() -> ServeConfig:
    in_file = {"auth": {"senders": {"pager": FILE_SECRETS["auth.senders.pager"]}}}
    return load_config(None, env=SECRETS, overrides=in_file)


def test_every_secret_setting_is_found_by_its_type() -> None:
    found = secrecy.secret_values(_config())
    assert found == set(SECRETS.values()) | set(FILE_SECRETS.values())


def test_the_json_log_masks_every_secret_setting_and_reprs_withhold_them(captured: io.StringIO) -> None:
    config = _config()
    log = logging.getLogger("runbook.test")
    for value in [*SECRETS.values(), *FILE_SECRETS.values()]:
        log.warning("sending to %s failed", value, extra={"reason": f"with {value}"})
    text = captured.getvalue()
    lines = [json.loads(x) for x in text.splitlines()]
    assert len(lines) == len(SECRETS) + len(FILE_SECRETS)
    assert all(line["msg"] == "sending to *** failed" and line["reason"] == "with ***" for line in lines), lines
    for value in [*SECRETS.values(), *FILE_SECRETS.values()]:
        assert value not in text
        assert value not in repr(config) and value not in str(config)


def _post_through_httpx(url: str) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200)

    Notifier(url, transport=httpx.MockTransport(answer))  # installs the quieting, as the server does
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        client.post(url, json={"text": "x"})


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_http_client_libraries_log_no_request_url_at_any_level(fmt: str) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logformat.JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.DEBUG)
    saved = {n: logging.getLogger(n).level for n in ("httpx", "httpcore", "urllib3")}
    try:
        for name in saved:
            logging.getLogger(name).setLevel(logging.DEBUG)
        _post_through_httpx(SLACK)
        logging.getLogger("urllib3.connectionpool").debug(
            '%s://%s:%s "%s %s %s" %s %s', "https", "hooks.slack.com", 443, "POST",
            "/services/T0ABCDEF/B0GHIJKL/s3cr3tW3bh00kPathXYZ", "HTTP/1.1", 200, 2)
        logging.getLogger("kubernetes.client.rest").debug("response body: %s", '{"spec": {"token": "eyJhbGciOi"}}')
    finally:
        root.handlers = handlers
        root.setLevel(level)
        for name, lvl in saved.items():
            logging.getLogger(name).setLevel(lvl)
    text = stream.getvalue()
    assert "HTTP Request: POST https://hooks.slack.com/..." in text  # httpx's line, kept, without its path
    assert "s3cr3tW3bh00kPathXYZ" not in text and "T0ABCDEF" not in text and "eyJhbGciOi" not in text, text


def test_a_notification_failure_names_no_webhook_url(caplog: pytest.LogCaptureFixture) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot connect to {request.url}", request=request)

    from engine.serve.delivery import RetryPolicy

    notifier = Notifier(SLACK, transport=httpx.MockTransport(refuse), retry=RetryPolicy(attempts=1))
    with caplog.at_level(logging.DEBUG):
        notifier.notify(Notification("finished", "gpu-node-recovery", node="omen2", run_id="r-1"))
        assert notifier.flush(10)
        notifier.close(timeout=1.0)
    logged: list[Any] = [r.getMessage() for r in caplog.records]
    assert any("ConnectError" in m and "https://hooks.slack.com/..." in m for m in logged), logged
    assert not any("s3cr3tW3bh00kPathXYZ" in m for m in logged), logged
    assert "s3cr3tW3bh00kPathXYZ" not in json.dumps(notifier.health())  # /readyz shows the last error
