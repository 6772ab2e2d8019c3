"""The console's plans page (engine.serve.console, engine.serve.console.plans) through the Starlette
TestClient over the fake run starter: a saved plan file uploaded and shown like a run's plan; bad
uploads (not JSON, not a plan, tampered, huge, no CSRF) refused with a located message and nothing
recorded; a plan requested for a runbook + node goes to ``RunStarter.preview`` and starts no run.
The browser drives the same page in tests/integration/test_console_browser.py."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from engine.serve.console.plans import MAX_PLAN_BYTES, UploadError, parse_params, parse_plan_file
from tests.fakes import (
    APPROVER_TOKEN,
    READER_TOKEN,
    FakeRunStarter,
    saved_plan,
    served,
    trigger_spec,
)


def _login(client: Any, credential: str) -> None:
    client.cookies.clear()
    page = client.get("/ui/login")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token is not None
    r = client.post("/ui/login", data={"csrf": token.group(1), "credential": credential}, follow_redirects=False)
    assert r.status_code == 303


def _csrf(client: Any) -> str:
    page = client.get("/ui/plans")
    assert page.status_code == 200
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def _starter() -> FakeRunStarter:
    return FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))],
                          plan=lambda run: saved_plan(run["params"]["node"]).model_dump(mode="json"))


def _upload(client: Any, csrf: str, data: bytes, name: str = "omen2.plan.json") -> Any:
    return client.post("/ui/plans/upload", data={"csrf": csrf}, files={"plan": (name, data, "application/json")})


def _nothing_recorded(starter: FakeRunStarter) -> None:
    assert starter.runs() == [] and starter.requests == [] and starter.executed == []


def test_an_uploaded_plan_file_is_shown_like_a_runs_plan_with_its_digest_and_diff_and_records_nothing() -> None:
    plan = saved_plan("omen2")
    with served("approve", starter=_starter()) as s:
        _login(s.client, READER_TOKEN)
        page = _upload(s.client, _csrf(s.client), plan.model_dump_json(indent=2).encode())
        assert page.status_code == 200, page.text
        assert f'<code id="digest">{plan.digest}</code>' in page.text
        assert '<span class="del">-/swap.img none swap sw 0 0</span>' in page.text
        assert '<span class="add">+#/swap.img none swap sw 0 0' in page.text
        assert "ansible-playbook -i INVENTORY -l omen2 playbooks/disable-swap.yml" in page.text
        assert 'id="step-swap-off"' in page.text and "the file omen2.plan.json, uploaded by grafana" in page.text
        _nothing_recorded(s.starter)


def test_a_plan_file_changed_after_it_was_saved_is_refused_naming_the_digest_and_nothing_is_shown() -> None:
    data = json.loads(saved_plan("omen2").model_dump_json())
    data["steps"][0]["command"] = "ansible-playbook -l omen2 playbooks/wipe-disk.yml"  # digest kept
    with served("approve", starter=_starter()) as s:
        _login(s.client, APPROVER_TOKEN)
        page = _upload(s.client, _csrf(s.client), json.dumps(data).encode(), name="edited.json")
        assert page.status_code == 422
        assert "edited.json: digest:" in page.text and "changed after" in page.text
        assert "wipe-disk" not in page.text and 'id="plan"' not in page.text
        _nothing_recorded(s.starter)


@pytest.mark.parametrize(("data", "needle", "status"), [
    (b"", "the file is empty", 400),
    (b'{"format": "runbook-plan/v1",\n  "runbook": }', "line 2, column 14: not JSON", 400),
    (b"[1, 2]", "line 1: a plan file is a JSON object, not a list", 400),
    (b'{"runbook": "x"}', "format: expected runbook-plan/v1, found None", 400),
    (b"\xff\xfe plan", "byte 0: not UTF-8", 400),
])
def test_an_upload_that_is_not_a_plan_file_gets_a_located_error_and_changes_nothing(
        data: bytes, needle: str, status: int) -> None:
    with served("approve", starter=_starter()) as s:
        _login(s.client, APPROVER_TOKEN)
        page = _upload(s.client, _csrf(s.client), data, name="notes.txt")
        assert page.status_code == status and f"notes.txt: {needle}" in page.text, page.text[-2000:]
        assert 'role="alert"' in page.text and 'id="plan"' not in page.text
        _nothing_recorded(s.starter)


def test_a_plan_with_an_invalid_field_names_the_field() -> None:
    data = json.loads(saved_plan("omen2").model_dump_json())
    data["steps"][1]["kind"] = "reboot-everything"
    with pytest.raises(UploadError, match=r"^p.json: steps\.1\.kind: .*not a valid plan"):
        parse_plan_file("p.json", json.dumps(data).encode())


def test_a_huge_upload_is_refused_with_the_limit_and_changes_nothing() -> None:
    big = b'{"format": "runbook-plan/v1", "pad": "' + b"x" * (MAX_PLAN_BYTES + 200_000) + b'"}'
    with served("approve", starter=_starter()) as s:
        _login(s.client, APPROVER_TOKEN)
        page = _upload(s.client, _csrf(s.client), big, name="huge.json")
        assert page.status_code == 413 and f"at most {MAX_PLAN_BYTES} bytes" in page.text
        _nothing_recorded(s.starter)


def test_an_upload_without_the_sessions_csrf_token_or_without_a_session_shows_nothing() -> None:
    data = saved_plan("omen2").model_dump_json().encode()
    with served("approve", starter=_starter(), auth={"reads": "open"}) as s:
        _login(s.client, APPROVER_TOKEN)
        _csrf(s.client)
        forged = _upload(s.client, "forged", data)
        assert forged.status_code == 403 and 'id="plan"' not in forged.text
        s.client.cookies.clear()
        anonymous = _upload(s.client, "x", data)
        assert anonymous.status_code == 401 and 'id="plan"' not in anonymous.text


def test_a_requested_plan_comes_from_the_starters_preview_and_starts_no_run() -> None:
    with served("approve", starter=_starter()) as s:
        _login(s.client, READER_TOKEN)
        csrf = _csrf(s.client)
        page = s.client.post("/ui/plans/request", data={"csrf": csrf, "runbook": "gpu-node-recovery",
                                                        "node": "omen3", "params": "\nreason=page 4711\n"})
        assert page.status_code == 200, page.text
        assert s.starter.previews == [("gpu-node-recovery", {"reason": "page 4711"}, "omen3")]
        assert re.search(r'<code id="digest">[0-9a-f]{64}</code>', page.text)
        assert "ansible-playbook -i INVENTORY -l omen3" in page.text and "planned just now for grafana" in page.text
        _nothing_recorded(s.starter)


def test_a_plan_request_with_bad_params_an_unknown_runbook_or_no_csrf_plans_nothing() -> None:
    with served("approve", starter=_starter()) as s:
        _login(s.client, APPROVER_TOKEN)
        csrf = _csrf(s.client)
        bad = s.client.post("/ui/plans/request", data={"csrf": csrf, "runbook": "gpu-node-recovery",
                                                       "node": "omen3", "params": "reason=x\nno equals sign"})
        assert bad.status_code == 400 and "params, line 2: expected name=value" in bad.text
        unknown = s.client.post("/ui/plans/request", data={"csrf": csrf, "runbook": "rm-rf", "node": "omen3"})
        assert unknown.status_code == 422 and "no runbook named" in unknown.text
        forged = s.client.post("/ui/plans/request", data={"csrf": "forged", "runbook": "gpu-node-recovery",
                                                          "node": "omen3"})
        assert forged.status_code == 403
        assert s.starter.previews == []
        _nothing_recorded(s.starter)


def test_params_lines_parse_and_the_node_belongs_in_its_field() -> None:
    assert parse_params(" a = 1 \n\nb=x=y") == {"a": "1", "b": "x=y"}
    with pytest.raises(UploadError, match="line 1: give the node in the Node field"):
        parse_params("node=omen2")
