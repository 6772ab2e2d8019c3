"""Approve and reject from Slack: the interactive message, and signed clicks through the console's rules.

Against ``tests/fakes/oncall.py``: Slack's Web API (``chat.postMessage``, ``chat.update``) on
127.0.0.1, and ``block_actions`` interactions form-encoded and signed as Slack signs them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from engine.serve.slack import SlackSignatureError, sign, verify
from tests.fakes import Served, alert, served, wait_for
from tests.fakes.oncall import (
    SLACK_BOT_TOKEN,
    SLACK_CHANNEL,
    SLACK_SIGNING_SECRET,
    OnCallFakes,
    SlackMessage,
    click,
    running,
)

ALICE, BOB, MALLORY, SENDER = "U0ALICE01", "U0BOB0001", "U0MALLORY", "U0SENDER1"


@pytest.fixture
def fakes() -> Iterator[OnCallFakes]:
    with running() as f:
        yield f


def test_the_signature_is_slacks_v0_algorithm_checked_against_slacks_documented_example() -> None:
    # Slack's "Verifying requests from Slack" walks through this request (a slash command) with this
    # signing secret and timestamp, and shows the signature it must produce.
    body = (b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&"
            b"channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&"
            b"response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F"
            b"96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c")
    expected = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
    assert sign(body, "8f742231b10e8888abcd99yyyzzz85a5", 1531420618) == expected
    verify(body, "1531420618", expected, "8f742231b10e8888abcd99yyyzzz85a5", now=1531420618 + 299)
    with pytest.raises(SlackSignatureError) as old:
        verify(body, "1531420618", expected, "8f742231b10e8888abcd99yyyzzz85a5", now=1531420618 + 301)
    assert old.value.status == 403
    with pytest.raises(SlackSignatureError) as tampered:
        verify(body + b"x", "1531420618", expected, "8f742231b10e8888abcd99yyyzzz85a5", now=1531420618)
    assert tampered.value.status == 403
    with pytest.raises(SlackSignatureError) as missing:
        verify(body, None, expected, "8f742231b10e8888abcd99yyyzzz85a5", now=1531420618)
    assert missing.value.status == 400


def _slack(fakes: OnCallFakes, **cfg: Any) -> Any:
    return served("approve", notify_from_config=True, public_url="https://runbook.example.org", notify={
        "retry": {"attempts": 3, "backoff": 0.05},
        "slack": {"bot_token": SLACK_BOT_TOKEN, "signing_secret": SLACK_SIGNING_SECRET, "channel": SLACK_CHANNEL,
                  "api_url": fakes.url + "/api",
                  "users": {ALICE: "alice", BOB: "bob", SENDER: "alertmanager"}}}, **cfg)


def _waiting(s: Served, fakes: OnCallFakes, node: str = "omen2") -> tuple[str, SlackMessage]:
    run_id = s.post_alerts(alert(node, fingerprint=f"fp-{node}")).json()["runs"][0]
    s.starter.wait_until(lambda st: st.run(run_id)["state"] == "waiting-approval")
    message = wait_for(lambda: fakes.approval_message(run_id), 10, "the approval message in Slack")
    return run_id, message


def _post(s: Served, body: bytes, headers: dict[str, str]) -> Any:
    return s.client.post("/hooks/slack", content=body, headers=headers)


def test_the_waiting_approval_message_is_interactive_and_a_signed_click_approves_as_the_mapped_approver(
        fakes: OnCallFakes) -> None:
    with _slack(fakes) as s:
        run_id, message = _waiting(s, fakes)
        assert message.channel == SLACK_CHANNEL
        buttons = message.buttons()
        assert [b["text"]["text"] for b in buttons.values()] == ["Approve this plan", "Reject with a reason"]
        digest = s.starter.run(run_id)["plan_digest"]
        assert {json.dumps(json.loads(b["value"]), sort_keys=True) for b in buttons.values()} == {
            json.dumps({"plan_digest": digest, "run_id": run_id}, sort_keys=True)}
        assert digest in message.shown() and f"https://runbook.example.org/ui/runs/{run_id}" in message.shown()

        r = _post(s, *click(message, user=ALICE))
        assert (r.status_code, r.json()["status"]) == (200, "approved"), r.text
        s.idle()
        run = s.starter.run(run_id)
        assert (run["approved_by"], run["state"]) == ("alice", "succeeded")
        wait_for(lambda: message.updates, 10, "the message to be updated")
        assert "Approved by alice" in message.shown() and not message.buttons()
        text = s.client.get("/metrics").text
        assert 'runbook_serve_webhook_requests_total{endpoint="slack",outcome="approved"} 1.0' in text
        assert 'runbook_serve_notifications_total{outcome="success",target="slack"}' in text


def test_a_replayed_unsigned_forged_or_old_click_changes_nothing(fakes: OnCallFakes) -> None:
    with _slack(fakes) as s:
        run_id, message = _waiting(s, fakes)
        body, headers = click(message, user=ALICE)
        unsigned = {k: v for k, v in headers.items() if not k.startswith("X-Slack")}
        assert _post(s, body, unsigned).status_code == 400
        forged = click(message, user=ALICE, secret="not-the-signing-secret-of-the-app")
        assert _post(s, *forged).status_code == 403
        old = click(message, user=ALICE, timestamp=int(__import__("time").time()) - 301)
        assert _post(s, *old).status_code == 403
        tampered = body.replace(ALICE.encode(), MALLORY.encode())
        assert _post(s, tampered, headers).status_code == 403
        assert s.starter.run(run_id)["approved_by"] is None  # nothing so far changed anything
        assert _post(s, body, headers).status_code == 200
        replay = _post(s, body, headers)
        assert replay.status_code == 409 and "already received" in replay.json()["error"]
        s.idle()
        assert len([e for e in s.starter.executed if e == run_id]) == 2  # planned once, continued once


def test_a_click_on_a_plan_that_changed_is_refused_and_the_message_says_why(fakes: OnCallFakes) -> None:
    with _slack(fakes) as s:
        run_id, message = _waiting(s, fakes)
        s.starter.replan(run_id, "b" * 64)  # the facts moved: the plan shown is not the run's any more
        r = _post(s, *click(message, user=ALICE))
        assert (r.status_code, r.json()["status"]) == (200, "conflict")
        assert s.starter.run(run_id)["approved_by"] is None
        wait_for(lambda: message.updates, 10, "the message to be updated")
        assert "approval by alice refused: the plan changed since this message was posted" in message.shown()
        assert not message.buttons()


def test_the_console_rules_apply_the_requester_cannot_approve_and_unknown_users_decide_nothing(
        fakes: OnCallFakes) -> None:
    with _slack(fakes) as s:
        run_id, message = _waiting(s, fakes)
        r = _post(s, *click(message, user=SENDER))  # mapped to the identity that requested the run
        assert r.json()["status"] == "forbidden"
        wait_for(lambda: len(message.updates) == 1, 10, "the first update")
        assert "requested by alertmanager" in message.shown() and message.buttons()  # still waiting
        r = _post(s, *click(message, user=MALLORY))
        assert r.json()["status"] == "forbidden"
        wait_for(lambda: len(message.updates) == 2, 10, "the second update")
        assert f"{MALLORY} is not mapped to an approver" in message.shown()
        assert s.starter.run(run_id)["approved_by"] is None


def test_reject_needs_a_reason_and_then_cancels_the_run_recorded_as_the_mapped_approver(fakes: OnCallFakes) -> None:
    with _slack(fakes) as s:
        run_id, message = _waiting(s, fakes)
        r = _post(s, *click(message, user=BOB, action="runbook-reject"))
        assert r.json()["status"] == "invalid" and s.starter.run(run_id)["state"] == "waiting-approval"
        wait_for(lambda: message.updates, 10, "the message to be updated")
        assert "write the reason" in message.shown() and message.buttons()
        r = _post(s, *click(message, user=BOB, action="runbook-reject", reason="omen2 is being drained by hand"))
        assert r.json()["status"] == "rejected"
        run = s.starter.run(run_id)
        assert (run["state"], run["rejected_by"], run["rejected_reason"]) == (
            "cancelled", "bob", "omen2 is being drained by hand")
        wait_for(lambda: "Rejected by bob" in message.shown(), 10, "the rejection shown")


def test_without_a_slack_app_the_endpoint_refuses_and_secrets_never_reach_the_log(
        fakes: OnCallFakes, caplog: pytest.LogCaptureFixture) -> None:
    with served("approve") as s:
        assert s.client.post("/hooks/slack", content=b"payload=%7B%7D").status_code == 503
    caplog.set_level(logging.DEBUG)
    with _slack(fakes) as s:
        _waiting(s, fakes)
        s.idle()
        config = s.dispatcher.config
        shown = repr(config) + repr(s.dispatcher.notifier.target("slack"))
    logged = "\n".join(r.getMessage() for r in caplog.records) + shown
    assert SLACK_BOT_TOKEN not in logged and SLACK_SIGNING_SECRET not in logged


def test_a_weak_signing_secret_is_refused_at_start_naming_the_variable() -> None:
    from engine.errors import UsageError
    from engine.serve.config import load_config

    env = {"RUNBOOK_SLACK_BOT_TOKEN": SLACK_BOT_TOKEN, "RUNBOOK_SLACK_SIGNING_SECRET": "short-secret"}
    with pytest.raises(UsageError) as e:
        load_config(None, env=env, overrides={"notify": {"slack": {"channel": SLACK_CHANNEL}}})
    assert "RUNBOOK_SLACK_SIGNING_SECRET" in str(e.value) and "short-secret" not in str(e.value)
    with pytest.raises(UsageError) as unmapped:
        load_config(None, env={**env, "RUNBOOK_SLACK_SIGNING_SECRET": SLACK_SIGNING_SECRET},
                    overrides={"notify": {"slack": {"channel": SLACK_CHANNEL, "users": {"alice": "alice"}}}})
    assert "is not a Slack user id" in str(unmapped.value)


def test_a_run_approved_in_the_console_stops_offering_buttons_and_its_message_shows_the_outcome(
        fakes: OnCallFakes) -> None:
    from tests.fakes import APPROVE

    with _slack(fakes) as s:
        run_id, message = _waiting(s, fakes)
        digest = s.starter.run(run_id)["plan_digest"]
        r = s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": digest}, headers=APPROVE)
        assert r.status_code == 202, r.text
        s.idle()
        wait_for(lambda: "run succeeded" in message.shown(), 10, "the message to show the outcome")
        assert "run started: approved by alice" in message.shown() and not message.buttons()
        assert digest in message.shown()
        thread = [m for m in fakes.messages if m.thread_ts == message.ts]
        assert len(thread) == 2  # started and finished, in the message's thread


@pytest.mark.parametrize("body", [b"", b"payload=", b"payload=%7B", b"payload=%5B%5D", b"\xff\xfe",
                                  b"payload=" + b"%5B" * 5000,
                                  b'payload={"type":"block_actions","actions":[{"action_id":"runbook-approve"}]}',
                                  b'payload={"type":"view_submission"}', b"other=1"])
def test_signed_garbage_is_400_never_500_and_changes_nothing(fakes: OnCallFakes, body: bytes) -> None:
    import time as _time

    with _slack(fakes) as s:
        ts = int(_time.time())
        r = _post(s, body, {"Content-Type": "application/x-www-form-urlencoded",
                            "X-Slack-Request-Timestamp": str(ts),
                            "X-Slack-Signature": sign(body, SLACK_SIGNING_SECRET, ts)})
        assert r.status_code == 400, r.text
        assert s.starter.requests == []
