"""Exact computations by enumeration: the KL between two language models over every response (``kl``), the
objective J_β = E[R] − β·KL(π‖π_ref), its optimum and the distance to it (``objective``), and the closed-form
optima of a tabular policy (``optima``). The trainer's evaluation, ``klgrad compare``, ``klgrad regime`` and the
reproduce targets use them."""
