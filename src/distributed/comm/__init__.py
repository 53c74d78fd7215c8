"""Layer 1, process groups and collectives: the named mesh (``mesh``), the one
group lookup (``runtime.resolve_group``), group health and bounded waits
(``health``), the collectives' one backend path (``ops``), the differentiable
collectives and Megatron-style region operators, communication overlapped
with computation (``overlap``: the switch; ``grad_reduce``, ``chunked``), devices.

May import: ``core``.
"""
