"""frameworks_grid.sh, the SmolLM2 head-to-head grid: its syntax, its methods (every id a klgrad method or a
framework preset, the list PROTOCOL.md describes), its primary hypothesis and its design flags."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

from klgrad.audit.framework_head import PRESETS_BY_ID
from klgrad.compare.claims import parse_claim
from klgrad.compare.design import METHODS
from klgrad.compare.hypotheses import check_claim

SCRIPT = Path(__file__).resolve().parent / "frameworks_grid.sh"
_spec = importlib.util.spec_from_file_location("smollm2_frameworks_protocol", SCRIPT.parent / "protocol.py")
_protocol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_protocol)
HEAD_TO_HEAD, HEAD_TO_HEAD_PRIMARY = _protocol.HEAD_TO_HEAD, _protocol.HEAD_TO_HEAD_PRIMARY


def script_methods() -> list[str]:
    """The METHODS the script passes to --methods (its two assignments joined)."""
    text = SCRIPT.read_text()
    first = re.search(r"^METHODS=([\w/,+-]+)$", text, re.M).group(1)
    more = re.search(r"^METHODS=\$METHODS,([\w/,+-]+)$", text, re.M).group(1)
    return f"{first},{more}".split(",")


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_method_exists_and_is_the_documented_list():
    methods = script_methods()
    assert methods == [m for m, _ in HEAD_TO_HEAD]
    for m in methods:
        assert m in METHODS or m in PRESETS_BY_ID, m


def test_the_primary_hypothesis_is_the_documented_one_between_two_of_its_methods():
    text = SCRIPT.read_text()
    assert f'PRIMARY="{HEAD_TO_HEAD_PRIMARY}"' in text
    check_claim(parse_claim(HEAD_TO_HEAD_PRIMARY), script_methods())


def test_the_design_is_pinned_same_strength_one_shaping_and_one_seed_per_invocation():
    text = SCRIPT.read_text()
    for flag in ("--beta-scale", "--only-seeds", "--level sequence", "--algo.shaping rloo", "--no-checkpoints"):
        assert flag in text, flag
    assert 'PIN=(--pin "$REV")' in text
    assert re.search(r"^STEPS=\$\{STEPS:-(\d+)\}$", text, re.M).group(1) == "40"
    assert int(re.search(r"^SEEDS=\$\{SEEDS:-(\d+)\}$", text, re.M).group(1)) >= 6
