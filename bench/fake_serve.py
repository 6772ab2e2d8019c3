"""``python -m bench.fake_serve HOST:PORT``: ``runbook serve``'s own ASGI app (``create_app``) under
uvicorn exactly as ``engine.serve.cli.serve`` runs it, but over ``FakeRunStarter`` and a static
cluster view: benchmark P5 without a lab (``bench/run --p5-fake``, or when no lab can start).

The token comes from ``RUNBOOK_WEBHOOK_TOKEN``, as for the real server.
"""

from __future__ import annotations

import logging
import sys


def main(listen: str) -> None:
    import uvicorn

    from engine.serve.app import create_app
    from engine.serve.cli import uvicorn_options
    from engine.serve.config import load_config, split_listen
    from tests.fakes import INCIDENT_NODES, FakeRunStarter, StaticClusterView, trigger_spec

    config = load_config(None, overrides={"listen": listen})
    starter = FakeRunStarter([trigger_spec("gpu-node-recovery", mode="approve")])
    cluster = StaticClusterView(INCIDENT_NODES)
    app = create_app(config, starter, cluster=cluster)
    host, port = split_listen(config.listen)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=host, port=port, log_level="info", lifespan="on", **uvicorn_options(config))


if __name__ == "__main__":
    main(sys.argv[1])
