"""Layer 5, training features: gradient clipping over the TP group (``clip``),
RNG streams for dropout (``rng``), the wrapper's loss and sequence
parallelism options (``options``).

May import: ``core``, ``comm``, ``layers``, ``plans``, ``hf``, ``guards``.
"""
