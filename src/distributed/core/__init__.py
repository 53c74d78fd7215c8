"""Layer 0, what every other layer may import: torchtp's errors, its logger,
the one split rule and cut (``layouts``), the compatibility fence for
torch's private names (``torch_compat``).

May import: nothing from torchtp.
"""
