"""The paper's ``klgrad reproduce`` targets: the target table (``targets``) and one module per target (k3
Gaussian and uniform bias, group-norm amplification and RL, off-policy, fixed points), beside the math, samplers,
training runs and reports they use."""
