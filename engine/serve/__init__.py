"""``runbook serve``: paging-triggered automation inside strict guards.

Alertmanager (webhook v4) and PagerDuty (v3, signed) pages are matched to runbook triggers and
turned into runs through dedup, exclusions, a circuit breaker and an approval budget; runs execute
in a bounded worker pool through a ``RunStarter`` (``engine.serve.starter``) that the engine
provides. Module map: ``app`` (HTTP), ``dispatcher`` (decisions), ``guards`` (dedup, breaker),
``cluster`` (health, exclusions, kured lock), ``triggers`` + ``matchers`` (matching, params),
``alertmanager`` + ``pagerduty`` (payloads, signatures), ``worker``, ``notify``, ``metrics``,
``config``, ``cli``; ``testing`` holds fakes. Importing this package starts nothing.
"""
