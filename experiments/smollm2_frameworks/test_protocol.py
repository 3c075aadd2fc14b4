"""protocol.py: PROTOCOL.md is what it writes from a fresh audit, and the grid's driver runs its methods."""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("smollm2_frameworks_protocol", HERE / "protocol.py")
protocol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protocol)


def test_protocol_md_is_up_to_date():
    committed = (HERE / "PROTOCOL.md").read_text(encoding="utf-8")
    assert committed == protocol.protocol_markdown(), "PROTOCOL.md is stale: run protocol.py (PYTHONPATH=src)"


def test_every_method_is_a_preset_or_a_klgrad_head_with_a_role():
    from klgrad.audit.presets import PRESETS
    from klgrad.kl import KL_HEADS

    ids = {p.id for p in PRESETS} | set(KL_HEADS)
    assert [m for m, _ in protocol.HEAD_TO_HEAD if m not in ids] == []
    assert all(role for _, role in protocol.HEAD_TO_HEAD)
