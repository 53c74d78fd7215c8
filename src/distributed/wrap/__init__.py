"""Layer 7, the wrapper: ``DistributedModelWrapper`` runs the pipeline
resolve -> agree -> apply -> hooks; each parallel dimension is one module
(``tp`` today).

May import: every layer below (not ``integrations``' entry points, ``cli``).
"""
