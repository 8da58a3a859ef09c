"""Helpers shared by the tools: CSV, Markdown and matplotlib figures, and CPU time from /proc."""

from __future__ import annotations

import csv
import os


def write_csv(path: str, rows: list[dict]) -> None:
    """Writes ``rows`` (dicts with the same keys) to ``path``, creating its directory."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def cpu_seconds(stat_path: str) -> float | None:
    """User + system CPU seconds from a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat``
    file; None where it cannot be read (the process or thread has ended)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend (the tools run headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
