"""The console and the server under attack, #25 items 9-13: nothing of an upload is read before the
caller is known (session, then the CSRF token as soon as it has arrived), the part limit stops the
reading, parsing runs in worker threads and the bytes count toward the shared body budget; live
streams are capped and their store reads bounded; sessions are capped per identity, expire when
idle and end on the server at logout, login failures are throttled; hostile plan files get a located
4xx; ``/healthz`` tells no node, run or breaker; every answer carries ``nosniff``.

Mechanisms are tested here, not timings (the machine is shared): the latency figures under a flood
are measured by ``bench/p10_floods.py``."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.requests import Request

from engine.serve.access import Access, Identity
from engine.serve.config import load_config
from engine.serve.console import SESSION_COOKIE, Console
from engine.serve.console.plans import UploadError, parse_plan_file
from tests.fakes import (
    APPROVER_TOKEN,
    READ,
    READER_TOKEN,
    FakeRunStarter,
    alert,
    saved_plan,
    served,
    trigger_spec,
)

BOUNDARY = "rb7MA4YWxkTrZu0gW"


def _login(client: Any, credential: str) -> Any:
    client.cookies.clear()
    page = client.get("/ui/login")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token is not None
    return client.post("/ui/login", data={"csrf": token.group(1), "credential": credential},
                       follow_redirects=False)


def _console(s: Any) -> Console:
    route = next(r for r in s.client.app.routes if getattr(r, "path", "") == "/ui/plans/upload")
    console: Console = route.endpoint.__self__
    return console


# -- item 9: uploads ----------------------------------------------------------------------------


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


class Body:
    """An upload arriving in chunks; counts the chunks the server asked for."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.taken = 0
        self.seen_budget: list[tuple[int, int]] = []
        self.console: Console | None = None

    async def receive(self) -> dict[str, Any]:
        if self.console is not None:
            self.seen_budget.append((self.console.budget.reads, self.console.budget.bytes))
        if self.taken >= len(self.chunks):
            return {"type": "http.request", "body": b"", "more_body": False}
        chunk = self.chunks[self.taken]
        self.taken += 1
        return {"type": "http.request", "body": chunk, "more_body": self.taken < len(self.chunks)}


def _upload(console: Console, body: Body, session: str = "") -> Any:
    total = sum(len(c) for c in body.chunks)
    headers = [(b"host", b"testserver"), (b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode()),
               (b"content-length", str(total).encode())]
    if session:
        headers.append((b"cookie", f"{SESSION_COOKIE}={session}".encode()))
    scope = {"type": "http", "method": "POST", "path": "/ui/plans/upload", "headers": headers, "query_string": b"",
             "client": ("10.1.2.3", 5555), "server": ("testserver", 80), "scheme": "http", "root_path": "",
             "path_params": {}}
    body.console = console
    return asyncio.run(console.upload_plan(Request(scope, body.receive)))


def _many_parts(csrf: bytes, parts: int = 20000) -> list[bytes]:
    """A 1 MiB multipart body of ``parts`` parts (52 bytes each: no name, a filler header), in 64 KiB chunks."""
    filler = f"--{BOUNDARY}\r\nX: \r\n\r\nv\r\n".encode()
    filler = filler.replace(b"X: ", b"X: " + b"p" * (52 - len(filler)))
    data = _part("csrf", csrf) + filler * parts + f"--{BOUNDARY}--\r\n".encode()
    assert len(data) <= 1024 * 1024 + 200
    return [data[i:i + 65536] for i in range(0, len(data), 65536)]


@pytest.fixture
def console_served() -> Iterator[tuple[Any, Console]]:
    with served("approve", auth={"reads": "token"}) as s:
        yield s, _console(s)


def test_an_upload_without_a_session_is_refused_before_a_byte_of_it_is_read(
        console_served: tuple[Any, Console]) -> None:
    _, console = console_served
    body = Body(_many_parts(b"whatever"))
    answer = _upload(console, body)
    assert answer.status_code == 401
    assert body.taken == 0, f"{body.taken} of {len(body.chunks)} chunks read before the caller was known"


def test_a_wrong_csrf_token_stops_the_upload_as_soon_as_its_first_part_has_arrived(
        console_served: tuple[Any, Console]) -> None:
    _, console = console_served
    key, _ = console._new_session(Identity("grafana", "reader"))
    body = Body(_many_parts(b"not-the-token"))
    answer = _upload(console, body, key)
    assert answer.status_code == 403 and b"CSRF" in answer.body
    assert body.taken == 1, f"{body.taken} of {len(body.chunks)} chunks read after a wrong CSRF token"


def test_twenty_thousand_parts_stop_the_reading_at_the_part_limit_and_every_byte_counts_in_the_budget(
        console_served: tuple[Any, Console]) -> None:
    _, console = console_served
    key, sess = console._new_session(Identity("grafana", "reader"))
    body = Body(_many_parts(sess.csrf.encode()))
    answer = _upload(console, body, key)
    assert answer.status_code == 400 and b"more than 10 parts" in answer.body
    assert body.taken == 1 < len(body.chunks) == 16  # stopped in the first 64 KiB of 1 MiB
    # while it was read, the upload was one of the server's bodies and held its declared bytes
    assert body.seen_budget and all(reads == 1 and held > 0 for reads, held in body.seen_budget)
    assert (console.budget.reads, console.budget.bytes) == (0, 0)  # and gave them back


def test_an_upload_waits_for_the_shared_body_budget(console_served: tuple[Any, Console]) -> None:
    _, console = console_served
    key, sess = console._new_session(Identity("grafana", "reader"))
    console.budget.reads = console.budget.max_reads  # the webhooks hold every body slot
    body = Body(_many_parts(sess.csrf.encode(), parts=2))
    assert _upload(console, body, key).status_code == 503 and body.taken == 0


def test_the_upload_is_split_and_parsed_in_worker_threads_not_on_the_event_loop(
        console_served: tuple[Any, Console], monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.serve.console as console_module

    _, console = console_served
    key, sess = console._new_session(Identity("grafana", "reader"))
    where: list[str] = []
    for name in ("multipart_fields", "parse_plan_file"):
        real = getattr(console_module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            where.append(f"{_name}:{'loop' if threading.current_thread() is threading.main_thread() else 'worker'}")
            return _real(*args, **kwargs)

        monkeypatch.setattr(console_module, name, spy)
    plan = saved_plan("omen2").model_dump_json().encode()
    data = _part("csrf", sess.csrf.encode()) + _part("plan", plan, "omen2.plan.json") + f"--{BOUNDARY}--\r\n".encode()
    answer = _upload(console, Body([data[:100], data[100:]]), key)
    assert answer.status_code == 200, answer.body[:500]
    assert where == ["multipart_fields:worker", "parse_plan_file:worker"]


# -- item 12: hostile plan files --------------------------------------------------------------


@pytest.mark.parametrize(("data", "needle"), [
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    (b'{"format": "runbook-plan/v1", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}", "nested too deeply"),
    (b'{"format": "runbook-plan/v1", "n": ' + b"9" * 20000 + b"}", "not a plan file"),
    (b'{"format": "runbook-plan/v1", "n": NaN}', "NaN"),
    (b'{"format": "runbook-plan/v1", "s": "\\ud800"}', "not valid Unicode"),
])
def test_a_hostile_json_plan_is_a_located_4xx_never_a_500(data: bytes, needle: str) -> None:
    with pytest.raises(UploadError, match=needle) as e:
        parse_plan_file("evil.json", data)
    assert 400 <= e.value.status < 500 and str(e.value).startswith("evil.json: ")
    starter = FakeRunStarter([trigger_spec(mode="approve")])
    with served("approve", starter=starter) as s:
        assert _login(s.client, READER_TOKEN).status_code == 303
        page = s.client.get("/ui/plans").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf is not None
        answer = s.client.post("/ui/plans/upload", data={"csrf": csrf.group(1)},
                               files={"plan": ("evil.json", data, "application/json")})
        assert answer.status_code == 400 and "evil.json: " in answer.text, answer.text[:300]
        assert starter.runs() == []


# -- item 10: live streams --------------------------------------------------------------------


class CountingRuns:
    """The dispatcher's ``run``: a waiting run, reads counted."""

    def __init__(self) -> None:
        self.reads = 0

    def run(self, run_id: str) -> dict[str, Any]:
        self.reads += 1
        return {"id": run_id, "state": "waiting-approval", "events": [], "plan": {}}


def _following(runs: int, viewers_per_run: int, seconds: float, **console: Any) -> int:
    """Store reads made in ``seconds`` (after the first look) while ``runs`` runs are followed."""
    config = load_config(None, env={}, overrides={"console": console})
    fake = CountingRuns()
    c = Console(config, fake, Access(config))  # type: ignore[arg-type]

    async def follow() -> int:
        watches = [c._watch(f"r-{i}") for i in range(runs) for _ in range(viewers_per_run)]
        await asyncio.sleep(0.3)
        before = fake.reads
        await asyncio.sleep(seconds)
        made = fake.reads - before
        for w in watches:
            w.viewers -= 1
        await asyncio.sleep(c.poll_interval() + 0.2)
        return made

    return asyncio.run(follow())


def test_sixty_runs_followed_cost_fewer_than_sixty_store_reads_a_second_in_total() -> None:
    made = _following(60, 1, 2.0)
    assert made < 2 * 60, f"{made} store reads in 2 s for 60 followed runs (today's code: ~1200)"
    assert made <= 2 * 20 + 60  # console.live_reads_per_second (20) over 2 s, plus one round's slack


def test_sixty_viewers_of_one_run_share_one_watcher() -> None:
    made = _following(1, 60, 2.0)
    assert made <= 2 * 10 + 1  # one read every 0.1 s at most


def test_streams_are_capped_per_session_per_client_and_in_total() -> None:
    with served("auto", auth={"reads": "token"}, console={"max_streams_per_session": 2,
                                                          "max_streams_per_client": 3, "max_streams": 4}) as s:
        assert s.post_alerts(alert("omen2")).status_code == 202
        s.idle()
        run_id = s.starter.runs()[0]["id"]
        assert _login(s.client, READER_TOKEN).status_code == 303
        console = _console(s)
        key = s.client.cookies.get(SESSION_COOKIE)
        slots = console.streams
        for _ in range(2):
            assert slots.admit(key, "testclient") is None  # two streams of this session are open
        refused = s.client.get(f"/ui/runs/{run_id}/live")
        assert refused.status_code == 429 and "this session" in refused.text
        assert slots.admit("other-session", "testclient") is None  # a third from this address
        s.client.cookies.clear()
        assert _login(s.client, APPROVER_TOKEN).status_code == 303
        refused = s.client.get(f"/ui/runs/{run_id}/live")
        assert refused.status_code == 429 and "this address" in refused.text
        assert slots.admit("far-session", "10.9.9.9") is None  # the fourth: the server is full
        full = s.client.get(f"/ui/runs/{run_id}/live", headers={"x-forwarded-for": "1.2.3.4"})
        assert full.status_code in (429, 503)
        for args in (("far-session", "10.9.9.9"), ("other-session", "testclient")):
            slots.release(*args)
        assert s.starter.run(run_id)["state"] == "succeeded"  # its stream ends at once
        live = s.client.get(f"/ui/runs/{run_id}/live")  # a slot is free again; the stream gives it back
        assert live.status_code == 200 and "event: end" in live.text
        assert slots.total == 2 and slots.by_session == {key: 2}


# -- item 11: sessions ------------------------------------------------------------------------


def _session_works(s: Any, key: str) -> bool:
    s.client.cookies.clear()
    s.client.cookies.set(SESSION_COOKIE, key)
    return s.client.get("/ui/", follow_redirects=False).status_code == 200


def test_sessions_are_capped_per_identity_and_one_identity_never_evicts_anothers() -> None:
    with served("approve", auth={"reads": "token"},
                console={"max_sessions_per_identity": 3, "max_sessions": 4}) as s:
        _login(s.client, READER_TOKEN)
        grafana = s.client.cookies.get(SESSION_COOKIE)
        alice = []
        for _ in range(6):
            assert _login(s.client, APPROVER_TOKEN).status_code == 303
            alice.append(s.client.cookies.get(SESSION_COOKIE))
        assert _session_works(s, grafana)  # today's code: evicted by alice's logins
        assert [_session_works(s, k) for k in alice] == [False, False, False, True, True, True]


def test_a_session_ends_when_idle_and_logout_ends_it_on_the_server() -> None:
    with served("approve", auth={"reads": "token"}) as s:
        _login(s.client, READER_TOKEN)
        key = s.client.cookies.get(SESSION_COOKIE)
        console = _console(s)
        assert _session_works(s, key)
        console.sessions[key].last_seen = time.time() - 1801
        assert not _session_works(s, key)  # idle longer than console.idle_seconds (30 min)
        _login(s.client, READER_TOKEN)
        key = s.client.cookies.get(SESSION_COOKIE)
        assert _session_works(s, key)
        # a logout (here without the page's form token) ends the session on the server: a copy of
        # the cookie opens nothing afterwards
        assert s.client.post("/ui/logout", follow_redirects=False).status_code == 303
        assert not _session_works(s, key)


def test_login_failures_are_throttled_per_client() -> None:
    with served("approve", auth={"reads": "token", "failures_per_minute": 4}) as s:
        codes = [_login(s.client, f"wrong-credential-{i:04d}").status_code for i in range(6)]
        assert codes == [401] * 4 + [429] * 2, codes
        refused = _login(s.client, READER_TOKEN)
        assert refused.status_code == 429 and "retry-after" in refused.headers
        assert s.client.get("/runs", headers=READ).status_code in (200, 429)


# -- item 13: /healthz and nosniff ------------------------------------------------------------


def test_healthz_says_only_that_the_server_lives_and_counts() -> None:
    with served("approve") as s:
        assert s.post_alerts(alert("omen2")).status_code == 202
        s.idle()
        run_id = s.starter.runs()[0]["id"]
        health = s.client.get("/healthz")
        assert health.status_code == 200
        text = health.text
        assert "omen2" not in text and run_id not in text and "breaker" not in text, text
        assert set(health.json()) == {"status", "triggers", "runs_tracked", "workers", "role"}
        assert run_id in json.dumps(s.client.get("/breaker").json())  # readers see it there


def test_every_answer_says_nosniff() -> None:
    with served("approve", auth={"reads": "token"}) as s:
        answers = [s.client.get("/healthz"), s.client.get("/readyz"), s.client.get("/runs"),
                   s.post_alerts(alert("omen2"), headers={}), s.client.get("/ui/login"),
                   s.client.get("/ui/static/console.css"), s.client.get("/ui/", follow_redirects=False),
                   s.client.get("/runs", headers={"Host": "evil.example"}), s.client.get("/nowhere")]
        for a in answers:
            assert a.headers.get("x-content-type-options") == "nosniff", (a.request.url, a.status_code)
