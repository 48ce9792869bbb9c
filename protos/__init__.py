"""gRPC contract of the SpecInfer service (package ``specinfer.v1``).

``specinfer.proto`` is the source; ``specinfer_pb2*.py`` are generated from it and committed.
Regenerate with ``python -m protos.codegen``; a test fails when the committed stubs are stale.
"""
