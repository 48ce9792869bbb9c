"""Generate the Python stubs for ``protos/specinfer.proto`` with grpcio-tools.

    python -m protos.codegen            # rewrite the committed stubs in place
    python -m protos.codegen --check    # exit 1 when they are stale

The proto is compiled with the repository root as include path, so the generated gRPC module
imports ``from protos import specinfer_pb2`` and the stubs work as a package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO = "protos/specinfer.proto"
GENERATED = ("protos/specinfer_pb2.py", "protos/specinfer_pb2.pyi", "protos/specinfer_pb2_grpc.py")
ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path, root: Path = ROOT) -> dict[str, str]:
    """Compile the proto into ``out_dir``; return {relative path: text} of the generated files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{root}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(root / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return {name: (out_dir / name).read_text(encoding="utf-8") for name in GENERATED}


def stale_files(root: Path = ROOT) -> list[str]:
    """The committed stubs that differ from a fresh generation (missing ones included)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), root)
    return [name for name, text in fresh.items()
            if not (root / name).exists() or (root / name).read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {name} (run python -m protos.codegen)", file=sys.stderr)
        return 1 if stale else 0
    for name, text in generate(Path(tempfile.mkdtemp())).items():
        (ROOT / name).write_text(text, encoding="utf-8")
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
