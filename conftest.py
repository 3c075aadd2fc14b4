"""Two tiers in one test command: the library's tests (tests/) run first; if any of them fails, the checks of the
tools (tools/) and of the studies (experiments/) are skipped, each skip saying why, so a red library is reported
in the first minutes and not buried under the studies' checks. ``python -m pytest -q`` (the README's command, what
CI runs) collects tests/, then tools/, then experiments/ (pyproject's testpaths, in that order)."""

from __future__ import annotations

from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parent / "tests"
_failed: list[str] = []


def _in_library(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(LIBRARY)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _in_library(item):
        _failed.append(item.nodeid)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _failed and not _in_library(item):
        pytest.skip(f"the library's tests failed first ({_failed[0]}, {len(_failed)} in all): fix those")
