"""Regenerate the Python modules of proto/harts/v1 from the .proto files.

Run: `make proto` (or `python -m proto.generate [--out DIR]`). A test regenerates into a
temporary folder and fails when the committed modules are stale.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto" / "harts" / "v1"
SERVICES = {"planner.proto"}


def proto_files() -> list[pathlib.Path]:
    """The .proto sources, sorted."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Generate `*_pb2.py`, `*_pb2.pyi` (and `*_pb2_grpc.py` for services) under `out`.

    Returns the generated files. Raises RuntimeError if protoc fails.
    """
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    for path in proto_files():
        rel = path.relative_to(REPO).as_posix()
        args = ["protoc", f"-I{REPO}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}"]
        if path.name in SERVICES:
            args.append(f"--grpc_python_out={out}")
        if protoc.main(args + [rel]) != 0:
            raise RuntimeError(f"protoc failed on {rel}")
    return sorted((out / "proto" / "harts" / "v1").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for f in generate(args.out):
        print(f.relative_to(args.out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
