"""The README's Python examples run as written (each ```python block, in order, one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_examples_run() -> None:
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, "README.md has no ```python examples"
    namespace: dict[str, object] = {}
    for index, block in enumerate(blocks):
        code = compile(block, f"README.md python block {index}", "exec")
        exec(code, namespace)
