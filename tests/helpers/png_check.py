"""Checks that a written PNG is a drawn figure: its pixel size, and enough ink and colours to be a plot."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, read from the PNG's IHDR chunk (bytes 16-24)."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def figure_pixels(figsize: tuple[float, float], dpi: float) -> tuple[int, int]:
    """The pixel size matplotlib gives a figure of ``figsize`` inches saved at ``dpi`` (no tight bbox)."""
    return round(figsize[0] * dpi), round(figsize[1] * dpi)


def assert_drawn(path: Path, size: tuple[int, int] | None = None, min_ink: float = 0.02, min_colours: int = 8) -> None:
    """The PNG has ``size`` (if given), at least ``min_ink`` of its pixels differ from the white background, and
    it uses at least ``min_colours`` distinct colours (a blank or single-colour image fails)."""
    if size is not None:
        assert png_size(path) == size
    from matplotlib.image import imread

    img = imread(str(path))[..., :3]  # (H, W, 3) floats in [0, 1]
    ink = float((img.min(axis=-1) < 0.95).mean())
    assert ink >= min_ink, f"{path}: only {ink:.1%} of the pixels are drawn"
    colours = np.unique((img.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0)
    assert len(colours) >= min_colours, f"{path}: {len(colours)} colours"
