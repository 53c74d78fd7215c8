"""Layer 7, the wrapper: ``DistributedModelWrapper`` runs the pipeline
resolve -> agree -> apply -> hooks; each parallel dimension is one module
(``tp`` today).

May import: every layer below (never ``integrations`` or ``cli``: the
integrations layer registers its steps in :mod:`.frameworks`).
"""
