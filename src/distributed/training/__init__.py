"""Layer 7, training features: gradient clipping over the TP group (``clip``),
the wrapper's loss and sequence parallelism options (``options``). The RNG
streams for dropout are the layers' (``torchtp.layers.rng``): the layers
switch them.

May import: ``core``, ``comm``, ``layers``, ``plans``, ``ep``, ``hf``, ``sp``;
never ``guards`` (the safety service, beside it, imports this folder).
"""
