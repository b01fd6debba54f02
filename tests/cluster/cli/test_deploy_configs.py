"""The deployment artifacts, checked by the tools that consume them rather than by eye.

configs/config.toml must load with PieConfig; the `ray up` YAMLs must pass Ray's own cluster-config validation (the
steps `ray up` runs before it touches a provider); the Helm chart is rendered by a real `helm template` and every
object it yields is checked against its schema: Kubernetes' own (strict: unknown fields fail) for core kinds and
for the Ray pods' specs, KubeRay's CRD for the RayCluster, and PieConfig for the config.toml the head assembles from
the ConfigMap and the Secret. None of this starts Ray.
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pie_cluster.config import PieConfig
from ray.autoscaler._private.util import prepare_config, validate_config
from support.paths import ROOT

CHART = ROOT / "helm" / "pie"
CRDS = ROOT.parent / "shared" / "kuberay-crds"
KUBERNETES = "1.35"  # the Kubernetes version whose schemas (bundled by kubernetes-validate) the chart must meet

# `make` puts helm next to the venv's python (see the Makefile); a helm on PATH works too.
HELM = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")

# Values an operator might give: a real model from a volume beside an embedded one, GPU workers, MCP servers, a token
# that needs TOML escaping.
OVERRIDE = """
auth:
  tokens: {'tok-"quoted"': alice, tok-2: bob}
service: {port: 9000}
gpuWorkers: {gpusPerWorker: 2}
pie:
  models:
    - {name: big, path: /models/Qwen3-8B, tensor_parallel: 2, use_gpu: true}
    - {name: tiny, arch: qwen3}
  launcher: {default_deadline_s: 300}
  mcp:
    docs: {url: "http://docs.example.internal:8000/mcp"}
    search: {command: [/opt/tools/bin/python, /opt/tools/search.py], env: {INDEX: /opt/index}}
modelVolume:
  persistentVolumeClaim: {claimName: models, readOnly: true}
rayAuth: {secretName: pie-ray-token}
gcsFaultTolerance:
  enabled: true
  redisAddress: redis.pie.svc:6379
  redisPasswordSecret: {name: pie-redis, key: password}
  externalStorageNamespace: pie-prod
"""

RENDERS = {
    "tokens": ["--set", "auth.tokens.s3cret=alice"],  # the defaults plus the one thing they lack
    "no-auth": ["--set", "auth.enabled=false", "--set", "cpuWorkers.replicas=0"],  # no Secret, no worker group
    "override": ["-f", "-", "--set", "gpuWorkers.replicas=2"],
    "autoscaled": [  # CPU workers from 0 to 3, GPU workers (none at first) up to 4, by Ray's autoscaler
        "--set", "auth.tokens.s3cret=alice", "--set", "autoscaling.enabled=true",
        "--set", "autoscaling.upscalingMode=Conservative", "--set", "cpuWorkers.minReplicas=0",
        "--set", "cpuWorkers.maxReplicas=3", "--set", "gpuWorkers.maxReplicas=4",
    ],
}  # fmt: skip


# --- configs/config.toml --------------------------------------------------------------------------------------------


def test_example_config_loads_as_written():
    path = ROOT / "configs" / "config.toml"
    written = tomllib.loads(path.read_text())
    config = PieConfig.load(path)
    config.check_auth()
    assert [m.name for m in config.model] == ["default", "qwen3"]
    for entry, table in zip(config.model, written["model"], strict=True):
        assert entry.model_dump(include=set(table)) == table
    assert config.auth.enabled and config.auth.tokens == written["auth"]["tokens"]
    assert set(config.auth.tokens.values()) == {"alice", "bob"}
    assert config.server.host == "0.0.0.0"
    assert set(config.mcp_specs()) == {"docs", "search"}


def test_a_config_file_with_tokens_that_others_can_read_is_named_with_its_fix(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[auth]\ntokens = { "s3cret" = "alice" }\n')
    config = PieConfig.load(path)
    path.chmod(0o644)
    assert config.exposed_tokens(path) == (
        f"{path} holds [auth] tokens and is open to other users on this host (mode 644): chmod 600 {path}"
    )
    path.chmod(0o600)
    assert config.exposed_tokens(path) is None
    path.chmod(0o644)
    assert PieConfig.model_validate({"auth": {"enabled": False}}).exposed_tokens(path) is None  # no tokens to leak


def test_a_model_entry_names_a_backend_and_a_page_size_its_kernels_take():
    def entry(**fields):
        return PieConfig.model_validate({"model": [fields]}).model[0]

    assert entry(backend="vllm", page_size=32).backend == "vllm"
    with pytest.raises(ValueError, match="the vllm backend needs page_size 16 or a multiple of 32.*got 24"):
        entry(backend="vllm", page_size=24)
    with pytest.raises(ValueError, match="backend"):
        entry(backend="tensorrt")


# --- ray up cluster YAMLs -------------------------------------------------------------------------------------------


def _ray_up_checks(config: dict) -> None:
    """What `ray up` does to a cluster YAML before it asks the provider for nodes (commands._bootstrap_config)."""
    validate_config(prepare_config(config))


@pytest.mark.parametrize("name", ["cluster-cpu.yaml", "cluster-gpu.yaml"])
def test_ray_up_config_passes_rays_validation(name):
    text = (ROOT / "configs" / name).read_text()
    config = yaml.safe_load(text)
    _ray_up_checks(config)
    assert any('"torch==2.13.0" -e ~/pie-on-ray' in command for command in config["setup_commands"])
    assert config["file_mounts"]["~/pie-on-ray"] == "."
    started = re.search(r"pie start --address auto --config ~/pie-on-ray/(\S+)\"", text)
    assert started and PieConfig.load(ROOT / started.group(1))  # the documented `pie start` names a real config
    workers = [t for t in prepare_config(config)["available_node_types"].values() if t.get("max_workers", 0) > 0]
    assert workers and all(t.get("min_workers", 0) < t["max_workers"] for t in workers)  # nodes may come and go


@pytest.mark.parametrize("name", ["cluster-cpu.yaml", "cluster-gpu.yaml"])
def test_ray_up_config_turns_ray_token_auth_on_and_keeps_the_dashboard_local(name, tmp_path):
    config = yaml.safe_load((ROOT / "configs" / name).read_text())
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # the token reaches every node
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    # Ray runs every later command as `bash --login -c -i "source ~/.bashrc; ..."`: run the setup commands that
    # touch ~/.bashrc twice (`ray up` again), as Ray would, in a scratch home, and read what a later command sees.
    bashrc = [c for c in config["setup_commands"] if "~/.bashrc" in c]
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for command in bashrc * 2:
        subprocess.run(["bash", "-c", command], env=env, check=True)
    seen = subprocess.run(["bash", "-c", "source ~/.bashrc; echo $RAY_AUTH_MODE"], env=env, capture_output=True)
    assert seen.stdout.decode().strip() == "token"
    assert (tmp_path / ".bashrc").read_text().count("RAY_AUTH_MODE") == 1
    assert "chmod 600 ~/.ray/auth_token ~/pie-on-ray/configs/config.toml" in config["setup_commands"]


@pytest.mark.parametrize(
    ("name", "breaks"),
    [
        ("cluster-cpu.yaml", lambda c: c.update(setup_comands=c.pop("setup_commands"))),  # a misspelt key
        ("cluster-gpu.yaml", lambda c: c.update(head_node_type="gpu_8x")),  # a head type that is not declared
        ("cluster-gpu.yaml", lambda c: c["available_node_types"]["gpu_1x"].update(resources={"GPU": "one"})),
    ],
)
def test_ray_validation_rejects_a_broken_copy(name, breaks):
    config = copy.deepcopy(yaml.safe_load((ROOT / "configs" / name).read_text()))
    breaks(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        _ray_up_checks(config)


# --- the Helm chart -------------------------------------------------------------------------------------------------


def _helm(*args: str) -> subprocess.CompletedProcess:
    if HELM is None:
        pytest.skip("no helm binary: `make` installs one into .venv/bin (see the Makefile)")
    return subprocess.run(
        [HELM, "template", "pie", str(CHART), "--namespace", "pie", *args],
        input=OVERRIDE,  # read by `-f -`
        capture_output=True,
        text=True,
        timeout=60,
    )


@functools.cache
def _render(case: str) -> dict[str, dict]:
    """The chart's objects for one set of values, by kind (each kind appears once). Shared: do not mutate."""
    result = _helm(*RENDERS[case])
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    by_kind = {o["kind"]: o for o in objects}
    assert len(by_kind) == len(objects), [o["kind"] for o in objects]
    return by_kind


def _ray_pod_specs(cluster: dict) -> list[dict]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]


def _head(cluster: dict) -> dict:
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]


def _strict(schema: dict) -> dict:
    """A CRD schema that rejects unknown fields, as the API server's strict field validation does."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        open_ended = "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in node and not open_ended:
            node["additionalProperties"] = False
        stack.extend(node.get("properties", {}).values())
        for key in ("items", "additionalProperties"):
            stack.append(node.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            stack.extend(node.get(key, []))
    return schema


@functools.cache
def _crd_validator(plural: str, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.load((CRDS / f"ray.io_{plural}.yaml").read_text(), Loader=yaml.CSafeLoader)
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    return jsonschema.Draft7Validator(_strict(served[version]["schema"]["openAPIV3Schema"]))


def _pie_config(objects: dict[str, dict]) -> PieConfig:
    """config.toml as the head assembles it: the ConfigMap's file, then the Secret's [auth.tokens] if auth is on."""
    text = objects["ConfigMap"]["data"]["config.toml"]
    if "Secret" in objects:
        text += base64.b64decode(objects["Secret"]["data"]["tokens.toml"]).decode()
    return PieConfig.model_validate(tomllib.loads(text))


@pytest.mark.parametrize("case", RENDERS)
def test_chart_core_objects_pass_kubernetes_schemas(case):
    objects = _render(case)
    assert set(objects) == {"ConfigMap", "Service", "RayCluster"} | ({"Secret"} if case != "no-auth" else set())
    for obj in objects.values():
        if obj["apiVersion"] != "ray.io/v1":
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    for spec in _ray_pod_specs(objects["RayCluster"]):  # the Ray pods KubeRay will create from these templates
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": spec}
        kubernetes_validate.validate(pod, KUBERNETES, strict=True)


@pytest.mark.skipif(not CRDS.is_dir(), reason=f"KubeRay's CRDs are not at {CRDS} (../shared is absent)")
@pytest.mark.parametrize("case", RENDERS)
def test_chart_raycluster_passes_kuberay_crd(case):
    cluster = _render(case)["RayCluster"]
    validator = _crd_validator("rayclusters", "v1")
    validator.validate(cluster)
    broken = copy.deepcopy(cluster)
    broken["spec"]["headGroupSpec"]["rayStartParms"] = {}  # a misspelt field fails, as it would on the API server
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def test_chart_keeps_the_gcs_state_in_redis_when_asked():
    options = _render("override")["RayCluster"]["spec"]["gcsFaultToleranceOptions"]
    assert options == {
        "redisAddress": "redis.pie.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "pie-redis", "key": "password"}}},
        "externalStorageNamespace": "pie-prod",
    }
    assert "gcsFaultToleranceOptions" not in _render("tokens")["RayCluster"]["spec"]
    missing = _helm("--set", "auth.enabled=false", "--set", "gcsFaultTolerance.enabled=true")
    assert missing.returncode != 0 and "gcsFaultTolerance.redisAddress is required" in missing.stderr


@pytest.mark.parametrize("case", RENDERS)
def test_chart_worker_pods_drain_their_node_before_they_go(case):
    for group in _render(case)["RayCluster"]["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["/bin/bash", "-lc"] and command[2].startswith("pie drain --this-node --timeout 120")
        assert spec["terminationGracePeriodSeconds"] == 150  # the drain's timeout, then time to go


@pytest.mark.parametrize("case", RENDERS)
def test_chart_head_starts_pie_with_the_rendered_config(case):
    objects = _render(case)
    cluster, service = objects["RayCluster"], objects["Service"]
    config = _pie_config(objects)
    config.check_auth()
    assert config.server.host == "0.0.0.0" and config.server.port == service["spec"]["ports"][0]["port"]

    head = _head(cluster)
    container = head["containers"][0]
    script = container["args"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD &" in script
    assert "pie start --address auto --config /run/pie/config.toml" in script
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    sources = {v["name"]: v for v in head["volumes"]}
    mounted = {m["mountPath"]: sources[m["name"]] for m in container["volumeMounts"]}
    assert mounted["/etc/pie"]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    assert ("/etc/pie-auth/tokens.toml" in script) == config.auth.enabled
    if config.auth.enabled:
        assert mounted["/etc/pie-auth"]["secret"]["secretName"] == objects["Secret"]["metadata"]["name"]

    # The Service reaches the head pod (KubeRay labels it with the cluster's name) on the port Pie listens on.
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[service["spec"]["ports"][0]["targetPort"]] == config.server.port


@pytest.mark.parametrize("case", RENDERS)
def test_chart_turns_ray_token_auth_on_and_keeps_the_dashboard_local(case):
    """KubeRay's authOptions (validated against its CRD above) give every Ray container the cluster's token; the
    dashboard and Jobs API answer on the head pod's loopback only; the assembled config.toml is its owner's."""
    cluster = _render(case)["RayCluster"]
    secret = {"secretName": "pie-ray-token"} if case == "override" else {}
    assert cluster["spec"]["authOptions"] == {"mode": "token", **secret}
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    script = _head(cluster)["containers"][0]["args"][0]
    assert re.search(r"\(umask 077; cat [^)]*> /run/pie/config.toml\)", script)


def test_chart_turns_kuberays_autoscaler_on_with_each_groups_bounds():
    """Off by default: every group at its fixed size. On: the autoscaler sidecar with its options, and each group
    between its bounds, a group of no pods yet included when it may grow."""
    fixed = _render("tokens")["RayCluster"]["spec"]
    assert "enableInTreeAutoscaling" not in fixed and "autoscalerOptions" not in fixed
    assert [(g["groupName"], g["minReplicas"], g["replicas"], g["maxReplicas"]) for g in fixed["workerGroupSpecs"]] == [
        ("cpu", 1, 1, 1)
    ]
    scaled = _render("autoscaled")["RayCluster"]["spec"]
    assert scaled["enableInTreeAutoscaling"] is True
    assert scaled["autoscalerOptions"] == {"upscalingMode": "Conservative", "idleTimeoutSeconds": 60}
    groups = [(g["groupName"], g["minReplicas"], g["replicas"], g["maxReplicas"]) for g in scaled["workerGroupSpecs"]]
    assert groups == [("cpu", 0, 1, 3), ("gpu", 0, 0, 4)]


def test_chart_values_reach_the_cluster_and_config():
    objects = _render("override")
    config = _pie_config(objects)
    assert config.auth.tokens == {'tok-"quoted"': "alice", "tok-2": "bob"}
    assert [(m.name, m.path, m.tensor_parallel, m.use_gpu) for m in config.model] == [
        ("big", "/models/Qwen3-8B", 2, True),
        ("tiny", None, 1, None),
    ]
    assert config.model[1].arch == "qwen3" and config.launcher.default_deadline_s == 300
    specs = config.mcp_specs()
    assert specs["docs"].url == "http://docs.example.internal:8000/mcp"
    assert specs["search"].command == ("/opt/tools/bin/python", "/opt/tools/search.py")
    assert specs["search"].env == {"INDEX": "/opt/index"}

    groups = {g["groupName"]: g for g in objects["RayCluster"]["spec"]["workerGroupSpecs"]}
    assert groups["gpu"]["replicas"] == groups["gpu"]["minReplicas"] == groups["gpu"]["maxReplicas"] == 2
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 2
    for spec in _ray_pod_specs(objects["RayCluster"]):
        container = spec["containers"][0]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
        # Only the embedded model in use is built; `big` comes from the volume.
        assert "--arch qwen3" in container["args"][0] and "--arch llama" not in container["args"][0]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ([], "auth.enabled is true but auth.tokens is empty"),  # the defaults: auth on, no tokens
        (["--set", "auth.tokens.t=u", "--set", "gpuWorkers.replicas=-1"], "/gpuWorkers/replicas"),
        (["--set", "auth.tokens.t=u", "--set", "service.port=8080"], "/service/port"),
        (["--set", "auth.tokens.t=u", "--set", "pie.server.host=127.0.0.1"], "propertyName 'host'"),
        (["--set", "auth.tokens.t=u", "--set", "rayAuth.mode=none"], "/rayAuth/mode"),
        (["--set", "auth.tokens.t=u", "--set", "cpuWorkers.maxReplicas=0"], "maxReplicas (0) does not hold"),
        (["--set", "auth.tokens.t=u", "--set", "autoscaling.upscalingMode=Fast"], "/autoscaling/upscalingMode"),
    ],
)
def test_chart_refuses_values_pie_could_not_start_with(args, error):
    result = _helm(*args)
    assert result.returncode != 0 and error in result.stderr, result.stderr


def test_auto_picks_vllms_kernels_on_a_cpu_where_they_take_the_page_size_and_keeps_a_named_backend():
    from pie_workers.backends import resolve_backend

    installed = importlib.util.find_spec("vllm") is not None
    assert resolve_backend("auto", 16, "cpu") == ("vllm" if installed else "torch")
    assert resolve_backend("auto", 24, "cpu") == "torch"  # vLLM's CPU kernels take 16 or multiples of 32
    assert resolve_backend("auto", 16, "cuda") == "torch"
    assert resolve_backend("torch", 16, "cpu") == "torch"
    config = PieConfig.model_validate({"model": [{"name": "a"}, {"name": "b", "page_size": 24}]})
    assert [m.backend for m in config.model] == ["auto", "auto"]  # auto never refuses a page size
