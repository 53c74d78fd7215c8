"""Layer 7, checks and hooks: what must hold before any weight is cut
(``checks``: one verdict on every rank, via ``agreement`` and
``fingerprints``) and what runs per call (``hooks``, composing
``input_check``, ``forward_guard`` and ``step_check``).

May import: ``core``, ``comm``, ``layers``, ``plans``, ``ep``, ``hf``, ``sp``,
``training``.
"""
