"""`specinfer k8s render`: generate k8s/rayservice.yaml and k8s/models-pvc.yaml from configs/serve.yaml +
k8s/overlay.yaml."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from .k8s import DEFAULT_OUT, DEFAULT_OVERLAY, DEFAULT_PVC_OUT, DEFAULT_SERVE_CONFIG, render_files


def add_parsers(subparsers) -> None:
    k8s = subparsers.add_parser("k8s", help="Kubernetes manifests (KubeRay RayService)")
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True)
    ren = k8s_sub.add_parser("render", help="generate the RayService manifest from the Serve config and the overlay")
    ren.add_argument("--serve-config", type=Path, default=Path(DEFAULT_SERVE_CONFIG),
                     help="Ray Serve config (default %(default)s)")
    ren.add_argument("--overlay", type=Path, default=Path(DEFAULT_OVERLAY),
                     help="Kubernetes overlay (default %(default)s)")
    ren.add_argument("--out", default=DEFAULT_OUT, help="manifest to write, '-' for stdout (default %(default)s)")
    ren.add_argument("--pvc-out", default=None,
                     help=f"the model volume's PersistentVolumeClaim, sized for the models (default {DEFAULT_PVC_OUT}; "
                          "not written with --out - unless given)")
    ren.add_argument("--check", action="store_true",
                     help="write nothing; exit 1 when --out or --pvc-out differs from what would be generated")
    ren.set_defaults(handler=run_render)
    drain = k8s_sub.add_parser("drain-node", help="(preStop hook of the worker pods) drain this pod's Ray node: "
                                                  "Serve moves its replicas and finishes their requests; wait for it")
    drain.add_argument("--deadline-s", type=float, required=True,
                       help="the drain deadline Ray is given (render: server.drain_timeout_s)")
    drain.add_argument("--wait-s", type=float, required=True, help="return after this long at the latest")
    drain.add_argument("--address", default=None, help="GCS address (default $RAY_ADDRESS, which KubeRay sets)")
    drain.add_argument("--node-ip", default=None, help="this node's IP (default: the one Ray detects)")
    drain.set_defaults(handler=_run_drain_node)


def _run_drain_node(args) -> int:
    from .k8s_drain import run_drain_node

    return run_drain_node(args)


def run_render(args) -> int:
    rendered = render_files(args.serve_config, args.overlay)
    for note in rendered.notes:
        print(f"note: {note}", file=sys.stderr)
    pvc_out = args.pvc_out if args.pvc_out is not None else (None if args.out == "-" else DEFAULT_PVC_OUT)
    if pvc_out and rendered.pvc_text is None:
        print(f"note: {pvc_out} not rendered: models.volume is per_pod and the models' size is not known "
              "(set kubernetes.models.claim_size to render it)", file=sys.stderr)
        pvc_out = None
    outputs = [(args.out, rendered.text)] + ([(pvc_out, rendered.pvc_text)] if pvc_out else [])
    if args.check:
        return max(_check(out, text) for out, text in outputs)
    for out, text in outputs:
        _write(out, text)
    return 0


def _check(out: str, text: str) -> int:
    """0 when the file ``out`` holds ``text``, else 1 with the diff on stderr."""
    if out == "-":
        raise ValueError("--check needs files for --out and --pvc-out")
    path = Path(out)
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current == text:
        print(f"{path} is up to date")
        return 0
    sys.stderr.writelines(difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                               f"{path} (committed)", f"{path} (generated)"))
    print(f"{path} is stale: run `specinfer k8s render`", file=sys.stderr)
    return 1


def _write(out: str, text: str) -> None:
    if out == "-":
        sys.stdout.write(text)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text, encoding="utf-8")
    print(f"wrote {out}")
