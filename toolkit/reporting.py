"""Reports people compare: JSON + a Markdown table + a PNG plot beside it, all written atomically."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from toolkit.artifacts import atomic_write_text, atomic_write_with, write_json_atomic


def save_figure(fig, path: Path | str) -> None:
    """Lay out, write (atomically, as PNG) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    atomic_write_with(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)


def write_report(result: dict[str, Any], json_path: Path | str, markdown: Callable[[dict], str],
                 plot: Callable[[dict, Path], None]) -> tuple[Path, Path]:
    """RESULT.json, RESULT.md (the table) and RESULT.png (the plot); returns (md, png)."""
    json_path = Path(json_path)
    write_json_atomic(json_path, result)
    md = json_path.with_suffix(".md")
    atomic_write_text(md, markdown(result))
    png = json_path.with_suffix(".png")
    plot(result, png)
    return md, png
