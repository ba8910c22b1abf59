"""Plain aligned text tables, for ``redisbal status`` and the simulator's summaries."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(rows: Sequence[tuple[str, ...]]) -> str:
    """Plain aligned text table; the first row is the header. First column left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
