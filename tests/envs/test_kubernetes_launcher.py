"""KubernetesLauncher: the Deployment and Service it builds, error mapping, and (with KUBECONFIG) a real cluster."""

import inspect
import json
import os

import pytest

pytest.importorskip("kubernetes", reason="the k8s extra is not installed (pip install 'rollart_nb[k8s]')")

from kubernetes.client import ApiClient, V1Deployment, V1Service  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from rollart_nb.envs import KubernetesLauncher, RemoteEnv  # noqa: E402
from rollart_nb.envs.launchers.kubernetes import RUN_LABEL, api_error  # noqa: E402
from rollart_nb.errors import ConfigError, ConnectError  # noqa: E402


def _roundtrip(obj, cls):
    """Serialize as the client would send it, then read it back as the API server's answer."""
    data = ApiClient().sanitize_for_serialization(obj)

    class Response:
        def __init__(self, d):
            self.data = json.dumps(d)

    api = ApiClient()
    if "content_type" in inspect.signature(api.deserialize).parameters:  # kubernetes >= 35: text + type
        return data, api.deserialize(json.dumps(data), cls, "application/json")
    return data, api.deserialize(Response(data), cls)


@pytest.fixture
def launcher():
    return KubernetesLauncher(
        "rollart_nb.envs:CodeTask",
        image="ghcr.io/example/rollart:0.1",
        replicas=3,
        namespace="rl",
        resources={"cpu": "500m", "memory": "512Mi"},
        labels={"team": "rl"},
        runtime_class="gvisor",
        kwargs={"timeout_s": 2.0},
        task="code",
    )


def test_deployment_runs_the_env_server_with_probes_resources_and_labels(launcher):
    data, d = _roundtrip(launcher.build_deployment(), V1Deployment)
    assert data["kind"] == "Deployment" and data["apiVersion"] == "apps/v1"
    assert d.metadata.name == launcher.name and d.metadata.namespace == "rl"
    assert d.metadata.name.startswith("rollart-env-code-") and len(d.metadata.name) <= 63
    labels = d.metadata.labels
    assert labels["team"] == "rl" and labels[RUN_LABEL] == launcher.run_id
    assert d.spec.replicas == 3
    assert d.spec.selector.match_labels.items() <= d.spec.template.metadata.labels.items()
    assert d.spec.template.metadata.labels[RUN_LABEL] == launcher.run_id
    pod = d.spec.template.spec
    assert pod.runtime_class_name == "gvisor" and pod.automount_service_account_token is False
    (c,) = pod.containers
    assert c.image == "ghcr.io/example/rollart:0.1" and c.command == ["rollart-nb"]
    args = c.args
    assert args[0] == "env-server"
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--env"] == "rollart_nb.envs:CodeTask" and json.loads(flags["--kwargs"]) == {"timeout_s": 2.0}
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "8000" and flags["--task"] == "code"
    assert flags["--replica-id"] == "$(POD_NAME)"  # expanded by the kubelet from the env var below
    assert c.env[0].name == "POD_NAME" and c.env[0].value_from.field_ref.field_path == "metadata.name"
    assert c.ports[0].container_port == 8000 and c.ports[0].name == "http"
    assert c.readiness_probe.http_get.path == "/v1/health" and c.readiness_probe.http_get.port == "http"
    assert c.liveness_probe.http_get.path == "/v1/health"
    assert c.resources.requests == {"cpu": "500m", "memory": "512Mi"} == c.resources.limits
    assert c.security_context.allow_privilege_escalation is False and c.security_context.capabilities.drop == ["ALL"]


def test_service_selects_the_pods_and_keeps_clients_on_one_pod(launcher):
    data, s = _roundtrip(launcher.build_service(), V1Service)
    assert data["kind"] == "Service"
    dep = launcher.build_deployment()
    assert s.spec.selector == dep.spec.selector.match_labels
    assert s.spec.session_affinity == "ClientIP"
    assert s.spec.ports[0].port == 8000 and s.spec.ports[0].target_port == "http"
    assert s.metadata.labels[RUN_LABEL] == launcher.run_id
    assert launcher.service_url == f"http://{launcher.name}.rl.svc.cluster.local:8000"


def test_separate_requests_and_limits_and_other_options():
    lau = KubernetesLauncher(
        "rollart_nb.envs:FrozenLake",
        image="img",
        port=9000,
        command=["python", "-m", "rollart_nb.cli"],
        resources={"requests": {"cpu": "1"}, "limits": {"cpu": "2"}},
    )
    c = lau.build_deployment().spec.template.spec.containers[0]
    assert (c.resources.requests, c.resources.limits) == ({"cpu": "1"}, {"cpu": "2"})
    assert c.command == ["python", "-m", "rollart_nb.cli"] and "--task" not in c.args
    assert lau.build_deployment().spec.template.spec.runtime_class_name is None
    other = KubernetesLauncher("rollart_nb.envs:FrozenLake", image="img")
    assert other.run_id != lau.run_id and other.name != lau.name  # run-unique names and labels
    with pytest.raises(ConfigError, match="2 problems"):
        KubernetesLauncher("rollart_nb.envs:FrozenLake", image="", port=0)


def test_missing_kubeconfig_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nope.yaml"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    lau = KubernetesLauncher("rollart_nb.envs:FrozenLake", image="img")
    with pytest.raises(ConfigError, match=r"no kubeconfig at .*nope.yaml.*set KUBECONFIG"):
        lau.start()
    assert lau.state == "new"
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\n")
    with pytest.raises(ConfigError, match="cannot use kubeconfig"):
        KubernetesLauncher("rollart_nb.envs:FrozenLake", image="img", kubeconfig=str(bad)).start()


def test_api_errors_map_to_errors_that_name_the_fix():
    denied = ApiException(status=403, reason="Forbidden")
    denied.body = json.dumps({"message": 'deployments.apps is forbidden: User "bob" cannot create'})
    e = api_error(denied, "create deployment", "rl")
    assert isinstance(e, ConfigError)
    assert "denied create deployment in namespace 'rl'" in str(e) and 'User "bob" cannot create' in str(e)
    assert "RBAC" in str(e)
    assert isinstance(api_error(ApiException(status=404, reason="Not Found"), "create service", "nope"), ConfigError)
    assert "namespace exists" in str(api_error(ApiException(status=404, reason="Not Found"), "x", "nope"))
    assert isinstance(api_error(ApiException(status=500, reason="boom"), "scale", "rl"), ConnectError)
    import urllib3

    down = urllib3.exceptions.MaxRetryError(None, "https://10.0.0.1:6443/apis", "connection refused")
    assert isinstance(api_error(down, "create deployment", "rl"), ConnectError)


def test_calls_through_the_launcher_raise_mapped_errors(launcher):
    class DeniedApps:
        def create_namespaced_deployment(self, namespace, body):
            raise ApiException(status=403, reason="Forbidden")

    launcher._apis = lambda: (DeniedApps(), None)
    with pytest.raises(ConfigError, match="Kubernetes denied create deployment in namespace 'rl'"):
        launcher.start()
    assert launcher.state == "new"


def test_remote_env_on_a_kubernetes_launcher_fails_episodes_not_the_rollout(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nope.yaml"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    env = RemoteEnv(launcher=KubernetesLauncher("rollart_nb.envs:FrozenLake", image="img"))
    from rollart_nb.errors import EnvError

    with pytest.raises(EnvError, match="cannot list the replicas of Kubernetes pods"):
        env.reset(0)


@pytest.mark.skipif(
    not os.environ.get("KUBECONFIG") or not os.environ.get("ROLLART_K8S_IMAGE"),
    reason="needs a cluster: set KUBECONFIG and ROLLART_K8S_IMAGE (an image with rollart_nb)",
)
def test_on_a_real_cluster():
    lau = KubernetesLauncher(
        "rollart_nb.envs:FrozenLake",
        image=os.environ["ROLLART_K8S_IMAGE"],
        replicas=1,
        namespace=os.environ.get("ROLLART_K8S_NAMESPACE", "default"),
    ).start()
    try:
        lau.wait_ready(300)
        assert len(lau.healthy()) == 1
        lau.scale(2)
        lau.wait_ready(300)
        assert len(lau.healthy()) == 2
    finally:
        lau.close()
    apps = lau._apis()[0]
    assert not apps.list_namespaced_deployment(lau.namespace, label_selector=lau.selector).items
