"""What the test folders share, imported as a package (``from tests.helpers.tolerances import gamma``): the derived
floating-point tolerances (tolerances.py), the tiny Llama/Qwen2 test models (tiny_llama.py), a small training config
(tiny_runs.py), the PNG checks of the figures (png_check.py), the case counts docs/reliability.md reports
(case_counts.py), the TRL tests' fixtures and gradient helpers (trl_checks.py; a test module binds the fixtures to
its own names), and the checks run inside a verl environment (verl_checks.py, started as a script)."""
