"""Layer 7, training features: gradient clipping over the TP group (``clip``),
RNG streams for dropout (``rng``), the wrapper's loss and sequence
parallelism options (``options``).

May import: ``core``, ``comm``, ``layers``, ``plans``, ``ep``, ``hf``, ``sp``,
``guards``.
"""
