"""No module in workbench/ grows past 500 lines: a long module is a sign that it owns two things."""

from pathlib import Path

import workbench

LIMIT = 500


def test_no_module_over_the_limit():
    root = Path(workbench.__file__).parent
    sizes = {
        p.relative_to(root).as_posix(): len(p.read_text().splitlines())
        for p in root.rglob("*.py")
    }
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split by responsibility): {over}"
