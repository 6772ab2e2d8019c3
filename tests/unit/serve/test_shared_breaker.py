"""The breaker shared across replicas (issue 15): two servers on one store (our in-memory fake), each
with its own guards, decide from the store's runs: a failed automatic run at one opens the node's
breaker at both, a reset at either closes it at both, the rate window counts both replicas' runs, an
unreadable store fails closed, and duplicate pages never read the store."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from tests.fakes import APPROVE, FakeLeadership, FakeRunStarter, Served, alert, served, trigger_spec

CFG: dict[str, Any] = {"dedup": {"node_cooldown": 0}}


class CountingStarter(FakeRunStarter):
    """The fake store, counting list reads; ``down`` makes every list fail (the API server gone)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.lists = 0
        self.down = False

    def runs(self, limit: int = 100, *, sources: tuple[str, ...] | None = None) -> Sequence[Mapping[str, Any]]:
        if self.down:
            raise ConnectionError("the API server does not answer")
        self.lists += 1
        return super().runs(limit, sources=sources)


def _store(fail: Sequence[str] = ()) -> CountingStarter:
    """One shared store; runs on the nodes in ``fail`` end failed."""
    return CountingStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))],
                           outcome=lambda run: "failed" if run["nodes"][0] in fail else "succeeded")


@contextmanager
def two_replicas(store: CountingStarter, **cfg: Any) -> Iterator[tuple[Served, Served]]:
    with ExitStack() as stack:
        a = stack.enter_context(served(starter=store, elector=FakeLeadership(True), **{**CFG, **cfg}))
        b = stack.enter_context(served(starter=store, elector=FakeLeadership(False), **{**CFG, **cfg}))
        yield a, b


def _page(s: Served, node: str, fingerprint: str) -> dict[str, Any]:
    r = s.post_alerts(alert(node, fingerprint=fingerprint))
    s.idle()
    (d,) = r.json()["decisions"]
    return dict(d)


def test_a_failed_automatic_run_at_one_replica_opens_the_node_breaker_at_the_other() -> None:
    store = _store(fail=["omen2"])
    with two_replicas(store) as (a, b):
        first = _page(a, "omen2", "fp-1")
        assert (first["outcome"], first["mode"]) == ("started", "auto")
        assert store.run(first["run_id"])["state"] == "failed"
        other = _page(b, "omen2", "fp-2")  # another alert, at the replica that did not run it
        assert (other["outcome"], other["mode"]) == ("started", "approve")
        assert any(f"the last automatic run on omen2 ({first['run_id']}) failed" in w for w in other["warnings"])
        assert "omen2" in b.client.get("/breaker", headers=APPROVE).json()["open_nodes"]


def test_a_reset_at_one_replica_closes_the_node_breaker_at_both() -> None:
    store = _store(fail=["omen2"])
    with two_replicas(store) as (a, b):
        failed = _page(a, "omen2", "fp-1")["run_id"]
        reset = b.client.post("/breaker/reset", json={"node": "omen2"}, headers=APPROVE)
        assert reset.status_code == 200 and reset.json()["reset"] == ["node:omen2"]
        assert [e for e in store.run(failed)["events"] if e["kind"] == "breaker.reset"] == [
            {"kind": "breaker.reset", "scope": "node", "by": "alice"}]
        store.outcome = lambda run: "succeeded"
        again = _page(a, "omen2", "fp-3")  # A opened it itself; B's reset is in the store
        assert (again["outcome"], again["mode"], again.get("warnings", [])) == ("started", "auto", [])
        assert "omen2" not in a.client.get("/breaker", headers=APPROVE).json()["open_nodes"]


def test_the_rate_window_counts_the_automatic_runs_of_both_replicas_until_a_reset() -> None:
    store = _store()
    with two_replicas(store, breaker={"max_auto_runs": 2, "max_unhealthy_nodes": 100}) as (a, b):
        assert _page(a, "omen1", "fp-1")["mode"] == "auto"
        assert _page(b, "omen2", "fp-2")["mode"] == "auto"
        third = _page(a, "omen3", "fp-3")  # A started one itself: only the store knows of B's
        assert third["mode"] == "approve"
        assert any("2 automatic runs of gpu-node-recovery" in w for w in third["warnings"])
        reset = b.client.post("/breaker/reset", json={"runbook": "gpu-node-recovery"}, headers=APPROVE)
        assert reset.json()["reset"] == ["runbook:gpu-node-recovery"]
        assert _page(a, "omen4", "fp-4")["mode"] == "auto"


def test_an_unreadable_store_turns_an_automatic_run_into_one_for_approval() -> None:
    store = _store()
    with two_replicas(store) as (a, _b):
        store.down = True
        d = _page(a, "omen2", "fp-1")
        assert (d["outcome"], d["mode"]) == ("started", "approve")
        assert any("shared run store did not answer" in w for w in d["warnings"])


def test_duplicate_pages_never_read_the_store_for_the_breaker() -> None:
    store = _store()
    with two_replicas(store) as (a, b):
        assert _page(a, "omen2", "fp-1")["outcome"] == "started"
        _page(b, "omen5", "fp-5")
        before = store.lists
        for _ in range(20):
            assert _page(b, "omen5", "fp-5")["outcome"] == "duplicate"
        assert store.lists == before


def test_one_replica_without_election_keeps_its_own_breaker_and_reads_no_store_for_it() -> None:
    store = _store(fail=["omen2"])
    with served(starter=store, **CFG) as s:
        after_start = store.lists
        assert _page(s, "omen2", "fp-1")["mode"] == "auto"
        assert _page(s, "omen2", "fp-2")["mode"] == "approve"  # its own breaker
        assert store.lists == after_start
