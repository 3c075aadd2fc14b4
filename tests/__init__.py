"""klgrad's tests. The folders mirror ``src/klgrad/`` (tests/trainer/ for klgrad.trainer, ...); the tests of a
top-level module (``klgrad.config``, ``klgrad.cli``, ...) and of the package as a whole sit here at the top
(tests/test_architecture.py checks the layout). This file makes ``tests`` a package so that the shared helpers import
as ``tests.helpers.<name>``; pytest's ``pythonpath = ["."]`` (pyproject) puts the checkout's root on ``sys.path`` for
that. The test modules themselves are imported with ``--import-mode=importlib``, so two of the same name in
different folders do not collide and the test folders need no ``__init__.py``."""
