"""Layer 7, the safety service: what must hold before any weight is cut
(``checks``: one verdict on every rank, via ``agreement`` and
``fingerprints``), what runs per call (``forward_door``, composing
``input_check`` and ``forward_guard``) and per optimizer step (``step_check``).

May import: ``core``, ``comm``, ``layers``, ``plans``, ``ep``, ``hf``, ``sp``,
``training``.
"""
