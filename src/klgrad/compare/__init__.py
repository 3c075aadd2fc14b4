"""The ``klgrad compare`` and ``klgrad regime`` products: the KL comparison as a grid of training runs scored by
exact metrics, in one module per stage (records, design, runs, measurements, hypotheses, render, plots, report,
grid; docs/architecture.md), the paired and Welch statistics its verdicts rest on (``stats``), and which regime a
config's prompts are in (``regime``)."""
