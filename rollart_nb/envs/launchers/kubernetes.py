"""KubernetesLauncher: env-server replicas as a Deployment + Service (official ``kubernetes`` client).

Per env type: a Deployment whose pods run ``rollart-nb env-server --host 0.0.0.0 --port 8000
...`` (readiness and liveness probes on ``/v1/health``, so a hung pod leaves the endpoints and
is restarted, and the Deployment replaces a dead one), and a Service in front of it. Every
object carries a run-unique label, and :meth:`KubernetesLauncher.close` deletes by that label.

:class:`~rollart_nb.envs.RemoteEnv` talks to the ready pods directly (``urls``: pod IPs, so
reachable from inside the cluster) and keeps each episode on its pod; the Service
(``service_url``, ``sessionAffinity: ClientIP``) is the single address for other clients.

Pod security: no service-account token is mounted, privilege escalation is off and all
capabilities are dropped; pass ``runtime_class="gvisor"`` (or kata) for a sandboxed runtime.

Needs the ``k8s`` extra: ``pip install 'rollart_nb[k8s]'``.
"""

from __future__ import annotations

import html
import json
import re
import time
import uuid
from typing import Any

from rollart_nb.envs.launchers._procs import env_spec
from rollart_nb.errors import ConfigError, ConnectError, RollartError, StateError

__all__ = ["KubernetesLauncher", "KubernetesReplicas", "api_error"]

RUN_LABEL = "rollart.dev/run"
ENV_LABEL = "rollart.dev/env"


def _client() -> Any:
    try:
        import kubernetes
    except ImportError as e:
        raise ConfigError("KubernetesLauncher needs the kubernetes client: pip install 'rollart_nb[k8s]'") from e
    return kubernetes


def load_kube_config(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ``ApiClient`` from ``kubeconfig`` (default ``$KUBECONFIG`` / ``~/.kube/config``), or
    the in-cluster service account when no kubeconfig exists and we run in a pod.

    Raises:
        ConfigError: no usable kubeconfig (the message says where it looked and what to set).
    """
    import os

    k8s = _client()
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    try:
        if os.path.exists(path.split(os.pathsep)[0]) or kubeconfig is not None:
            return k8s.config.new_client_from_config(config_file=path, context=context)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s.config.load_incluster_config()
            return k8s.client.ApiClient()
    except (k8s.config.ConfigException, OSError, TypeError, ValueError) as e:
        raise ConfigError(
            f"cannot use kubeconfig {path!r}: {e}; fix it, set KUBECONFIG, or pass kubeconfig=... / context=..."
        ) from e
    raise ConfigError(
        f"no kubeconfig at {path!r} and not running in a pod; set KUBECONFIG or pass "
        "kubeconfig=... to KubernetesLauncher"
    )


def api_error(e: Exception, action: str, namespace: str) -> RollartError:
    """A Kubernetes API failure as a rollart_nb error whose message names the fix."""
    status = getattr(e, "status", None)
    detail = getattr(e, "reason", "") or str(e)
    try:
        detail = json.loads(getattr(e, "body", "") or "{}").get("message") or detail
    except (TypeError, ValueError):
        pass  # a non-JSON body: keep the reason
    if status in (401, 403):
        return ConfigError(
            f"Kubernetes denied {action} in namespace {namespace!r} (HTTP {status}: {detail}); "
            "grant this user/service account RBAC to create, list, patch and delete deployments "
            "(apps) and services and pods in that namespace, or use another namespace/context"
        )
    if status == 404:
        return ConfigError(
            f"Kubernetes {action}: not found in namespace {namespace!r} ({detail}); check the "
            "namespace exists (kubectl get ns)"
        )
    if status == 409:
        return ConfigError(f"Kubernetes {action}: already exists ({detail}); close the previous launcher first")
    if status is not None and 400 <= status < 500:
        return ConfigError(f"Kubernetes rejected {action} (HTTP {status}: {detail}); check image, resources and labels")
    return ConnectError(
        f"Kubernetes API unreachable or failing during {action} ({type(e).__name__}: {detail}); "
        "check the cluster is up and the kubeconfig's server address"
    )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:30] or "env"


class KubernetesLauncher:
    """Env-server replicas of one env type on Kubernetes.

    Args:
        env: ``"module:Class"`` or the class (importable inside ``image``).
        image: container image with rollart_nb installed.
        command: the entry point in the image (default ``["rollart-nb"]``).
        replicas: pods.
        namespace: where to create the objects.
        resources: per pod, e.g. ``{"cpu": "1", "memory": "1Gi"}`` (requests = limits), or
            ``{"requests": {...}, "limits": {...}}``.
        labels: extra labels on every object and pod.
        runtime_class: RuntimeClass for the pods (e.g. "gvisor").
        port: the server's container port.
        kwargs: the env's constructor arguments (JSON-able).
        task: task name the servers report.
        kubeconfig / context: which cluster (default: ``$KUBECONFIG``, else in-cluster).

    Example:
        >>> lau = KubernetesLauncher("rollart_nb.envs:CodeTask", image="ghcr.io/me/rollart:0.1", replicas=4,
        ...                          runtime_class="gvisor").start()        # doctest: +SKIP
        >>> lau.wait_ready(300); env = rn.envs.RemoteEnv(launcher=lau)     # doctest: +SKIP
    """

    def __init__(
        self,
        env: Any,
        image: str,
        command: list[str] | None = None,
        replicas: int = 1,
        namespace: str = "default",
        resources: dict[str, Any] | None = None,
        labels: dict[str, str] | None = None,
        runtime_class: str | None = None,
        port: int = 8000,
        *,
        kwargs: dict[str, Any] | None = None,
        task: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        max_episodes: int = 256,
    ) -> None:
        self.env, self.image = env_spec(env), image
        problems = []
        if not image:
            problems.append("image must name a container image with rollart_nb installed")
        if not isinstance(replicas, int) or replicas < 0:
            problems.append(f"replicas must be an int >= 0, got {replicas!r}")
        if not 0 < port < 65536:
            problems.append(f"port must be 1..65535, got {port}")
        if problems:
            raise ConfigError(problems, where="KubernetesLauncher")
        self.command = list(command or ["rollart-nb"])
        self.replicas_wanted, self.namespace, self.port = replicas, namespace, port
        self.resources, self.runtime_class = dict(resources or {}), runtime_class
        self.kwargs, self.task, self.max_episodes = dict(kwargs or {}), task, max_episodes
        self.kubeconfig, self.context = kubeconfig, context
        self.run_id = uuid.uuid4().hex[:8]
        self.name = f"rollart-env-{_slug(task or self.env.rpartition(':')[2])}-{self.run_id}"
        self.labels = {
            "app.kubernetes.io/name": "rollart-env",
            "app.kubernetes.io/managed-by": "rollart_nb",
            **dict(labels or {}),
            RUN_LABEL: self.run_id,
            ENV_LABEL: self.name,
        }
        self.state = "new"
        self._api: Any = None
        self._handle: KubernetesReplicas | None = None

    @property
    def selector(self) -> str:
        """Label selector of this launcher's objects."""
        return f"{RUN_LABEL}={self.run_id},{ENV_LABEL}={self.name}"

    # -- the objects (pure: testable without a cluster) -----------------------------------
    def build_deployment(self) -> Any:
        """The Deployment (a ``kubernetes.client.V1Deployment``)."""
        m = _client().client
        args = [
            "env-server",
            "--env",
            self.env,
            "--kwargs",
            json.dumps(self.kwargs),
            "--host",
            "0.0.0.0",
            "--port",
            str(self.port),
            "--replica-id",
            "$(POD_NAME)",
            "--max-episodes",
            str(self.max_episodes),
        ]
        if self.task:
            args += ["--task", self.task]
        probe = {"http_get": m.V1HTTPGetAction(path="/v1/health", port="http")}
        container = m.V1Container(
            name="env-server",
            image=self.image,
            command=self.command,
            args=args,
            ports=[m.V1ContainerPort(name="http", container_port=self.port)],
            env=[
                m.V1EnvVar(
                    name="POD_NAME",
                    value_from=m.V1EnvVarSource(field_ref=m.V1ObjectFieldSelector(field_path="metadata.name")),
                )
            ],
            readiness_probe=m.V1Probe(**probe, period_seconds=2, failure_threshold=2),
            liveness_probe=m.V1Probe(**probe, initial_delay_seconds=10, period_seconds=10, failure_threshold=3),
            resources=self._resources(m),
            security_context=m.V1SecurityContext(
                allow_privilege_escalation=False, capabilities=m.V1Capabilities(drop=["ALL"])
            ),
        )
        pod = m.V1PodSpec(
            containers=[container], runtime_class_name=self.runtime_class, automount_service_account_token=False
        )
        return m.V1Deployment(
            api_version="apps/v1",
            kind="Deployment",
            metadata=m.V1ObjectMeta(name=self.name, namespace=self.namespace, labels=self.labels),
            spec=m.V1DeploymentSpec(
                replicas=self.replicas_wanted,
                selector=m.V1LabelSelector(match_labels={RUN_LABEL: self.run_id, ENV_LABEL: self.name}),
                template=m.V1PodTemplateSpec(metadata=m.V1ObjectMeta(labels=self.labels), spec=pod),
            ),
        )

    def build_service(self) -> Any:
        """The Service in front of the pods (a ``kubernetes.client.V1Service``)."""
        m = _client().client
        return m.V1Service(
            api_version="v1",
            kind="Service",
            metadata=m.V1ObjectMeta(name=self.name, namespace=self.namespace, labels=self.labels),
            spec=m.V1ServiceSpec(
                selector={RUN_LABEL: self.run_id, ENV_LABEL: self.name},
                session_affinity="ClientIP",  # an episode's steps reach its pod
                ports=[m.V1ServicePort(name="http", port=self.port, target_port="http")],
            ),
        )

    def _resources(self, m: Any) -> Any:
        if not self.resources:
            return None
        if set(self.resources) <= {"requests", "limits"}:
            return m.V1ResourceRequirements(
                requests=self.resources.get("requests"), limits=self.resources.get("limits")
            )
        return m.V1ResourceRequirements(requests=dict(self.resources), limits=dict(self.resources))

    # -- lifecycle ------------------------------------------------------------------------
    def _apis(self) -> tuple[Any, Any]:
        if self._api is None:
            self._api = load_kube_config(self.kubeconfig, self.context)
        k8s = _client().client
        return k8s.AppsV1Api(self._api), k8s.CoreV1Api(self._api)

    def _call(self, action: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RollartError:
            raise
        except Exception as e:  # ApiException, urllib3 connection errors
            raise api_error(e, action, self.namespace) from e

    def start(self) -> KubernetesLauncher:
        """Create the Deployment and the Service; returns self (see :meth:`wait_ready`)."""
        if self.state == "closed":
            raise StateError("KubernetesLauncher is closed; create a new one")
        if self.state == "running":
            return self
        apps, core = self._apis()
        self._call("create deployment", apps.create_namespaced_deployment, self.namespace, self.build_deployment())
        self.state = "running"
        try:
            self._call("create service", core.create_namespaced_service, self.namespace, self.build_service())
        except BaseException:
            self.close()
            raise
        return self

    @property
    def started(self) -> bool:
        return self.state == "running"

    def scale(self, n: int) -> None:
        """Run ``n`` pods."""
        if self.state != "running":
            raise StateError("KubernetesLauncher is not running; call .start() first")
        apps, _ = self._apis()
        self._call(
            "scale deployment",
            apps.patch_namespaced_deployment_scale,
            self.name,
            self.namespace,
            {"spec": {"replicas": int(n)}},
        )
        self.replicas_wanted = int(n)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every wanted pod is ready; ConnectError (with pod states) after ``timeout_s``."""
        apps, core = self._apis()
        deadline = time.monotonic() + timeout_s
        while True:
            d = self._call("read deployment", apps.read_namespaced_deployment_status, self.name, self.namespace)
            if (d.status.ready_replicas or 0) >= self.replicas_wanted:
                return
            if time.monotonic() > deadline:
                pods = self._call("list pods", core.list_namespaced_pod, self.namespace, label_selector=self.selector)
                states = "; ".join(f"{p.metadata.name}: {p.status.phase}" for p in pods.items) or "no pods"
                raise ConnectError(
                    f"{self.name}: {d.status.ready_replicas or 0}/{self.replicas_wanted} pods ready "
                    f"after {timeout_s:g}s ({states}); kubectl describe pods -l {self.selector}"
                )
            time.sleep(2.0)

    def close(self) -> None:
        """Delete every object of this run (by its label); idempotent."""
        if self.state != "running":
            self.state = "closed"
            return
        self.state = "closed"
        apps, core = self._apis()
        self._call(
            "delete deployments",
            apps.delete_collection_namespaced_deployment,
            self.namespace,
            label_selector=self.selector,
        )
        for svc in self._call(
            "list services", core.list_namespaced_service, self.namespace, label_selector=self.selector
        ).items:
            self._call("delete service", core.delete_namespaced_service, svc.metadata.name, self.namespace)

    def __enter__(self) -> KubernetesLauncher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- replicas -------------------------------------------------------------------------
    @property
    def service_url(self) -> str:
        return f"http://{self.name}.{self.namespace}.svc.cluster.local:{self.port}"

    def healthy(self) -> list[tuple[str, str]]:
        """(pod name, url) of the ready pods."""
        return self.handle().replicas()

    @property
    def urls(self) -> list[str]:
        return [u for _, u in self.healthy()]

    def handle(self) -> KubernetesReplicas:
        """A picklable view of the ready pods (one per launcher, so its short cache is shared)."""
        if self._handle is None:
            self._handle = KubernetesReplicas(self.namespace, self.selector, self.port, self.kubeconfig, self.context)
        return self._handle

    def __repr__(self) -> str:
        return (
            f"KubernetesLauncher({self.env}, image={self.image}, {self.namespace}/{self.name}, "
            f"replicas={self.replicas_wanted}, {self.state})"
        )

    def _repr_html_(self) -> str:
        return f"<div><b>KubernetesLauncher</b> <code>{html.escape(repr(self))}</code></div>"


class KubernetesReplicas:
    """Picklable view of a KubernetesLauncher's ready pods (listed at most every ``ttl_s``)."""

    def __init__(
        self,
        namespace: str,
        selector: str,
        port: int,
        kubeconfig: str | None = None,
        context: str | None = None,
        ttl_s: float = 2.0,
    ) -> None:
        self.namespace, self.selector, self.port = namespace, selector, port
        self.kubeconfig, self.context, self.ttl_s = kubeconfig, context, ttl_s
        self._core: Any = None
        self._cache: tuple[float, list[tuple[str, str]]] = (0.0, [])

    def replicas(self) -> list[tuple[str, str]]:
        if time.monotonic() - self._cache[0] < self.ttl_s:
            return list(self._cache[1])
        if self._core is None:
            self._core = _client().client.CoreV1Api(load_kube_config(self.kubeconfig, self.context))
        try:
            pods = self._core.list_namespaced_pod(self.namespace, label_selector=self.selector).items
        except Exception as e:
            raise api_error(e, "list pods", self.namespace) from e
        ready = [
            (p.metadata.name, f"http://{p.status.pod_ip}:{self.port}")
            for p in pods
            if p.status.pod_ip and any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
        ]
        self._cache = (time.monotonic(), ready)
        return list(ready)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_core": None, "_cache": (0.0, [])}

    def __repr__(self) -> str:
        return f"Kubernetes pods {self.selector} in {self.namespace}"
