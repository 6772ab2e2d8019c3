"""runbook: a guarded remediation runbook engine.

Stages: load -> resolve params -> gather facts -> plan -> confirm -> execute -> report.
The package never talks to an outside system except through ``engine.connectors``.
"""

__version__ = "0.1.0"
