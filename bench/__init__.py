"""runbook's benchmarks (issue 9): the engine against hand-written procedures, and its own costs.

Run ``bench/run`` (see ``docs/performance.md``). Modules: ``common`` (metrics, timing, the lab),
``p1_recovery`` (P1 and P6), ``p2_verify``, ``p3_cold``, ``p4_plan``, ``p5_webhook``, ``rss`` (the
in-process wrapper that reports the engine's peak RSS) and ``fake_serve`` (``runbook serve``'s app
over a fake run starter, for P5 without a lab).
"""
