"""klgrad.plotting: pyplot() selects Agg without importing matplotlib at klgrad's import; save() writes and closes."""

from __future__ import annotations

import os
import subprocess
import sys

from klgrad.plotting import pyplot, save
from tests.helpers.png_check import assert_drawn, figure_pixels, png_size


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # pyplot() must choose the backend itself
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


def test_import_does_not_load_matplotlib_and_pyplot_selects_agg():
    out = _python(
        "import sys, klgrad.plotting as p\n"
        "print('matplotlib' in sys.modules)\n"
        "plt = p.pyplot()\n"
        "print(plt.get_backend().lower())\n"
    )
    assert out.split() == ["False", "agg"]


def test_an_existing_pyplot_keeps_its_backend():
    out = _python(
        "import matplotlib\nmatplotlib.use('svg')\nimport matplotlib.pyplot\n"
        "from klgrad.plotting import pyplot\nprint(pyplot().get_backend())\n"
    )
    assert out.strip() == "svg"


def test_save_writes_the_figure_at_its_size_and_closes_it(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.0, 3.0))
    ax.plot([0, 1, 2], [0, 1, 4], lw=3, color="tab:red")
    ax.set_title("a line")
    number = fig.number
    save(fig, tmp_path / "f.png", dpi=50)
    assert not plt.fignum_exists(number)
    assert_drawn(tmp_path / "f.png", figure_pixels((4.0, 3.0), 50), min_ink=0.01, min_colours=3)


def test_save_passes_savefig_keywords(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.0, 3.0))
    ax.plot([0, 1], [0, 1])
    save(fig, tmp_path / "tight.png", dpi=50, bbox_inches="tight")
    w, h = png_size(tmp_path / "tight.png")
    assert (w, h) != figure_pixels((4.0, 3.0), 50)  # the tight box crops the figure's margins
