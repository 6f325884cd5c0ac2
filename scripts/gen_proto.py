"""Regenerate the Python code of the wire contract from proto/privfusion/v1/*.proto.

    .venv/bin/python scripts/gen_proto.py            # rewrites proto/privfusion/v1/*_pb2*.py(i)
    .venv/bin/python scripts/gen_proto.py --out DIR  # writes into DIR instead (the drift test)

The one way the generated files are made: grpcio-tools' bundled protoc, the include root is
``proto/`` so that the generated imports read ``from privfusion.v1 import ..._pb2`` (proto/
mirrors the package path). The generated files are committed; tests/test_proto.py fails when
they differ from what this script produces.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("privfusion") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every .proto; return the generated files (under out_root/privfusion/v1)."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "grpc_tools":
            raise
        raise SystemExit(
            "scripts/gen_proto.py needs grpcio-tools, which is not installed: install the 'dev' extra "
            "(pip install -e '.[dev]')"
        ) from None

    out_root = Path(out_root)
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with status {rc}")
    return sorted(p for p in (out_root / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: proto/, in place)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
