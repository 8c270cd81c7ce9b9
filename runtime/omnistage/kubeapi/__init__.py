"""The one Kubernetes client: async REST on plain dicts, list+watch, every write counted.

Why one client: the operator's writes and lists, the orchestrator's Pod watch, the test harness
and the benches all talk to the API server. They share this module, so credentials, errors,
retries and watch semantics are the same everywhere. kopf still runs the operator's own watches;
`KubeConfig.connection_info()` feeds it the same credentials. Objects stay JSON dicts exactly as
the API server sends them: no generated model classes. Counting writes (every non-GET) is how the
operator's idle-resync goal, zero writes, is measured.

Credentials: in a pod, the service account; elsewhere kubeconfig as kubectl reads it (merged
$KUBECONFIG list, contexts, certificates, token files, exec plugins), through the `kubernetes`
package's loader, imported only then. The loader supplies server, CA, client certificate and a
token; an exec plugin's token is renewed on expiry or a 401, and this client sends every request.

Synchronous code (tests, benches) uses `SyncKubeApi`: this same client on a private event loop in
a daemon thread, not a second HTTP implementation.

The package, by job: `errors` (ApiError, ConfigError, WatchExpired), `resources` (REST paths and
views), `auth` (KubeConfig, ExecPlugin: credentials), `client` (KubeApi, WriteLimit, the watch
types), `sync` (SyncKubeApi). Every public name is importable from here; the submodules import
each other directly, never through this __init__.
"""

from __future__ import annotations

from omnistage.kubeapi.auth import (
    EXEC_RENEW_EARLY_S,
    SA_DIR,
    ExecPlugin,
    KubeConfig,
    default_namespace,
    in_cluster,
    kubeconfig_paths,
)
from omnistage.kubeapi.client import (
    APPLY_PATCH,
    PATCH_TYPES,
    Applied,
    KubeApi,
    Listed,
    WatchEvent,
    WriteLimit,
    gather_all,
)
from omnistage.kubeapi.errors import ApiError, ConfigError, WatchExpired, namespace_terminating
from omnistage.kubeapi.resources import (
    RESOURCES,
    Fields,
    Obj,
    Resource,
    path,
    project,
    resource_path,
)
from omnistage.kubeapi.sync import SyncKubeApi

__all__ = [
    "APPLY_PATCH",
    "EXEC_RENEW_EARLY_S",
    "PATCH_TYPES",
    "RESOURCES",
    "SA_DIR",
    "ApiError",
    "Applied",
    "ConfigError",
    "ExecPlugin",
    "Fields",
    "KubeApi",
    "KubeConfig",
    "Listed",
    "Obj",
    "Resource",
    "SyncKubeApi",
    "WatchEvent",
    "WatchExpired",
    "WriteLimit",
    "default_namespace",
    "gather_all",
    "in_cluster",
    "kubeconfig_paths",
    "namespace_terminating",
    "path",
    "project",
    "resource_path",
]
