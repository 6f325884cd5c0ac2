"""Print pyproject.toml's pinned dependencies as a requirements file (the image's dependency layer).

    python3 pinned-requirements.py pyproject.toml           # every dependency, as pinned
    python3 pinned-requirements.py pyproject.toml --torch   # torch alone, its CPU build: torch==X+cpu

Refuses a torch requirement that is not one exact version (``torch==X``), so the CPU build
installed is always the version the project pins."""

from __future__ import annotations

import re
import sys
import tomllib


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or (len(argv) == 2 and argv[1] != "--torch"):
        print("usage: pinned-requirements.py PYPROJECT [--torch]", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    if len(argv) == 1:
        print("\n".join(dependencies))
        return 0
    torch = [d for d in dependencies if re.match(r"torch\s*[=<>!~ ]", d)]
    pin = re.fullmatch(r"torch==([0-9][0-9.]*)", torch[0].replace(" ", "")) if len(torch) == 1 else None
    if pin is None:
        print(f"{argv[0]}: project.dependencies: torch must be pinned once as torch==X, got {torch}", file=sys.stderr)
        return 1
    print(f"torch=={pin.group(1)}+cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
