"""Layer 9, the wrapper: ``DistributedModelWrapper`` runs the pipeline
resolve -> agree -> apply -> hooks; what is specific to a parallel dimension
lives in its folder (``ep``, ``sp``, ``pipeline``, ``cp``).

May import: every layer below (never ``integrations`` or ``cli``: the
integrations layer registers its steps in :mod:`.frameworks`).
"""
