"""Connectors: the only modules that talk to outside systems.

``kube`` is the only importer of ``kubernetes``; ``ansible`` the only importer of
``ansible_runner``. ``base`` holds the interfaces the rest of the engine depends on, so
unit tests can supply fakes (``tests/fakes/``).
"""
