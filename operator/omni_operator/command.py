"""`omnistage operator`, registered through the `omnistage.commands` entry point.

The runtime's CLI finds this function in the installed package metadata, so the runtime never
imports the operator. Kept free of kopf imports: building the parser must stay cheap, and a
missing operator extra is reported only when the command runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from omni_operator.network_policy import MONITORING_NAMESPACE
from omni_operator.replicas_cli import add_cluster_flags
from omnistage.cli import seconds_between


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _pod_labels(text: str) -> dict[str, str]:
    """KEY=VALUE[,KEY=VALUE...] (a label selector's equality form) as a dict; empty: none."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"want KEY=VALUE[,KEY=VALUE...], got {item!r}")
        out[key] = value
    return out


def _namespace_or_none(text: str) -> str:
    """A namespace name (a DNS-1123 label), or "" for none."""
    if text and (len(text) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", text)):
        raise argparse.ArgumentTypeError(f"not a namespace name: {text!r} (\"\" for none)")
    return text


def _rate(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no limit), got {text}")
    return value


#: Defaults of the limits that protect the API server, each also read from its environment
#: variable (the flag wins). charts/omnistage/README.md ("Concurrency and write limits") says
#: how they were chosen; the chart's `operator:` values set them.
WORKERS, WRITE_QPS, WRITE_BURST = 8, 200.0, 400
ENV_WORKERS = "OMNISTAGE_OPERATOR_WORKERS"
ENV_WRITE_QPS = "OMNISTAGE_OPERATOR_WRITE_QPS"
ENV_WRITE_BURST = "OMNISTAGE_OPERATOR_WRITE_BURST"


def register(sub: Any) -> None:
    """Add the `operator` subcommand to the `omnistage` subparsers."""
    o = sub.add_parser("operator", help="run the Kubernetes operator (needs the operator extra)")
    add_cluster_flags(o)
    o.add_argument("--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable; default: all namespaces)")
    o.add_argument("--metrics-host", default="127.0.0.1")
    o.add_argument("--metrics-port", type=int, default=8081,
                   help="serves /metrics (API write counts), /livez and /readyz")
    o.add_argument("--resync-seconds", type=_positive_float, default=30.0,
                   help="how often every object is re-checked (writes only on drift)")
    o.add_argument("--autoscaler", action=argparse.BooleanOptionalAction, default=True,
                   help="size pools whose stage has `autoscaling` (--no-autoscaler: leave every "
                        "pool's size to kubectl scale, an HPA or KEDA)")
    c = o.add_argument_group("API server protection",
                             "how hard the operator may push the API server "
                             "(charts/omnistage/README.md)")
    # String defaults: argparse runs them through `type`, so a bad variable fails like a bad flag.
    c.add_argument("--workers", type=_positive_int,
                   default=os.environ.get(ENV_WORKERS, str(WORKERS)),
                   help=f"objects reconciled at once (env {ENV_WORKERS}; default {WORKERS})")
    c.add_argument("--write-qps", type=_rate,
                   default=os.environ.get(ENV_WRITE_QPS, str(WRITE_QPS)),
                   help=f"API writes per second, sustained; 0: no limit "
                        f"(env {ENV_WRITE_QPS}; default {WRITE_QPS:g})")
    c.add_argument("--write-burst", type=_positive_int,
                   default=os.environ.get(ENV_WRITE_BURST, str(WRITE_BURST)),
                   help=f"API writes allowed at once above --write-qps "
                        f"(env {ENV_WRITE_BURST}; default {WRITE_BURST})")
    w = o.add_argument_group(
        "admission webhook", "kubectl apply runs omnistage's validator (see docs/crds.md)")
    w.add_argument("--webhook", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the validating webhook and manage its configuration")
    w.add_argument("--webhook-addr", default="127.0.0.1", help="listen address (0.0.0.0 in a pod)")
    w.add_argument("--webhook-port", type=int, default=9443)
    w.add_argument("--webhook-host", default=None,
                   help="host the API server calls in a url clientConfig (default: the address)")
    w.add_argument("--webhook-service", default=None, metavar="NAMESPACE/NAME[:PORT]",
                   help="call the webhook through this Service (in a cluster) instead of a URL")
    w.add_argument("--webhook-cert-dir", default=None,
                   help="tls.crt, tls.key and ca.crt (a cert-manager Secret); default: a "
                        "self-signed CA generated at start")
    w.add_argument("--webhook-failure-policy", choices=["Ignore", "Fail"], default="Ignore",
                   help="what the API server does when the webhook cannot be reached")
    n = o.add_argument_group(
        "network policy", "a NetworkPolicy per pipeline (docs/security.md, \"Network policy\")")
    n.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=True,
                   help="give each pipeline NetworkPolicies: its stage pods admit the worker ZMQ "
                        "port from its orchestrator pods only and the side port from the "
                        "operator's pods only; its orchestrator pods admit their API port from "
                        "anywhere and their admin port from the operator's pods and the "
                        "--monitoring-namespace only (--no-network-policy: none; existing ones "
                        "stay until deleted)")
    n.add_argument("--operator-pod-labels", type=_pod_labels, default={},
                   metavar="KEY=VALUE[,KEY=VALUE...]",
                   help="labels that select this operator's own pods, admitted to the stage "
                        "pods' side port (the drain reads /state there); without them no pod is "
                        "admitted there (the chart passes its selector labels)")
    n.add_argument("--operator-namespace", default=None,
                   help="namespace of this operator's pods (default: $POD_NAMESPACE)")
    n.add_argument("--monitoring-namespace", type=_namespace_or_none,
                   default=MONITORING_NAMESPACE, metavar="NAME",
                   help="every pod of this namespace (a Prometheus) is admitted to the "
                        "orchestrator pods' admin port, for /metrics; the operator's pods are "
                        f"too (default {MONITORING_NAMESPACE}; \"\": none)")
    a = o.add_argument_group(
        "admin credential", "what the operator presents at the orchestrators' admin listeners "
        "(control, GET /v1/load; docs/security.md)")
    a.add_argument("--admin-key-file", default=None, metavar="PATH",
                   help="the operator's root admin key: a file holding one key of at least 32 "
                        "characters (the chart mounts its Secret <release>-operator-admin-key). "
                        "Each pipeline's key is derived from it, and its orchestrator pods get "
                        "only the digest. Without it a key is made for this run, and an "
                        "operator restart rolls every orchestrator")
    a.add_argument("--curve-propagation", type=seconds_between(0, 3600), default=None,
                   metavar="SECONDS",
                   help="CurveZMQ key rotation: how long after a new pair is added to a "
                        "pipeline's Secret its pods move to it, so the kubelets refreshed every "
                        "pod's mount first (default 90: a kubelet's sync period with room)")
    o.add_argument("--leader-elect", action="store_true",
                   help="reconcile only while holding a coordination.k8s.io Lease, so several "
                   "replicas can run and one leads (the Helm chart turns this on)")
    o.add_argument("--leader-elect-namespace", default=None,
                   help="namespace of the Lease (default: the pod's own namespace)")
    o.add_argument("--leader-elect-name", default="omnistage-operator",
                   help="name of the Lease (default omnistage-operator)")
    o.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        from omni_operator.main import main
    except ImportError as exc:
        print(f"error: the operator needs its extra: pip install 'omnistage[operator]' ({exc})",
              file=sys.stderr)
        return 2
    from omnistage.kubeapi import ConfigError

    try:
        return main(args)
    except ConfigError as exc:  # no usable credentials, or an exec plugin that failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
