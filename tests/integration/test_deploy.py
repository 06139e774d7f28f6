"""deploy/: the Dockerfile, docker-compose.yml and the Kubernetes manifests are consistent.

No services are needed (marked `unit` as well): every YAML document parses; every Kubernetes
object is checked against a schema written here for the fields Cortex uses, and the objects
are checked against each other (Services select pods, ScaledObjects target the Deployment of
their pool and scale on every lane of its queue, a Redis list each, every referenced
ConfigMap, Secret key, PVC, port and TriggerAuthentication exists); the compose file has a
service per pool, Redis with AOF and Flower behind basic auth, and `docker compose config`
(or `docker-compose config`) accepts it where either is installed. The image is not built
here: its base image would have to be pulled from a registry.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cortex_worker.manifests.loader import load_registry
from cortex_worker.pools import NAMES as POOLS
from cortex_worker.pools import lanes
from cortex_worker.settings import Settings, hashed_key_entries
from cortex_worker.store.connect import SentinelTarget, parse_url

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
K8S_SENTINEL = DEPLOY / "k8s-sentinel"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_SENTINEL = DEPLOY / "docker-compose.sentinel.yml"
DOCKERFILE = DEPLOY / "Dockerfile"

# --------------------------------------------------------------------------- schemas

NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 63}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": NAME, "namespace": NAME, "labels": LABELS}}
QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti)?$"}
RESOURCES = {"type": "object", "required": ["requests", "limits"],
             "properties": {k: {"type": "object", "required": ["cpu", "memory"],
                                "properties": {"cpu": QUANTITY, "memory": QUANTITY},
                                "additionalProperties": False}
                            for k in ("requests", "limits")},
             "additionalProperties": False}
ARGV = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
PROBE = {"type": "object",
         "properties": {"httpGet": {"type": "object", "required": ["path", "port"]},
                        "exec": {"type": "object", "required": ["command"],
                                 "properties": {"command": ARGV}},
                        **{k: {"type": "integer", "minimum": 0} for k in (
                            "initialDelaySeconds", "periodSeconds", "timeoutSeconds",
                            "failureThreshold")}},
         "oneOf": [{"required": ["httpGet"]}, {"required": ["exec"]}]}
CONTAINER = {
    "type": "object",
    "required": ["name", "image", "command", "resources"],
    "properties": {
        "name": NAME, "image": {"type": "string", "minLength": 1}, "command": ARGV,
        "args": ARGV, "resources": RESOURCES,
        "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"]}},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "envFrom": {"type": "array"},
        "volumeMounts": {"type": "array", "items": {"type": "object",
                                                    "required": ["name", "mountPath"]}},
        "readinessProbe": PROBE, "livenessProbe": PROBE, "startupProbe": PROBE,
        "securityContext": {"type": "object"},
    },
    "additionalProperties": False,
}
MAIN_CONTAINER = {"allOf": [CONTAINER, {"anyOf": [{"required": ["livenessProbe"]},
                                                  {"required": ["readinessProbe"]}]}]}
POD_TEMPLATE = {
    "type": "object", "required": ["metadata", "spec"],
    "properties": {
        "metadata": {"type": "object", "required": ["labels"], "properties": {"labels": LABELS}},
        "spec": {"type": "object", "required": ["containers"], "properties": {
            "containers": {"type": "array", "minItems": 1, "items": MAIN_CONTAINER},
            "initContainers": {"type": "array", "items": CONTAINER},
            "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        }},
    },
}
SELECTOR = {"type": "object", "required": ["matchLabels"], "properties": {"matchLabels": LABELS}}


def _obj(api: str, kind: str, spec: dict[str, Any] | None = None,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object", "required": ["apiVersion", "kind", "metadata"],
        "properties": {"apiVersion": {"const": api}, "kind": {"const": kind},
                       "metadata": METADATA, **(extra or {})}}
    if spec is not None:
        schema["required"].append("spec")
        schema["properties"]["spec"] = spec
    return schema


SCHEMAS: dict[str, dict[str, Any]] = {
    "Namespace": _obj("v1", "Namespace"),
    "ConfigMap": _obj("v1", "ConfigMap", extra={"data": {
        "type": "object", "additionalProperties": {"type": "string"}}}),
    "Secret": _obj("v1", "Secret", extra={"type": {"const": "Opaque"}, "stringData": {
        "type": "object", "additionalProperties": {"type": "string"}}}),
    "Service": _obj("v1", "Service", {
        "type": "object", "required": ["selector", "ports"],
        "properties": {"selector": LABELS, "ports": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port"]}}}}),
    "PersistentVolumeClaim": _obj("v1", "PersistentVolumeClaim", {
        "type": "object", "required": ["accessModes", "resources"]}),
    "Deployment": _obj("apps/v1", "Deployment", {
        "type": "object", "required": ["replicas", "selector", "template"],
        "properties": {"replicas": {"type": "integer", "minimum": 0}, "selector": SELECTOR,
                       "template": POD_TEMPLATE}}),
    "StatefulSet": _obj("apps/v1", "StatefulSet", {
        "type": "object", "required": ["serviceName", "replicas", "selector", "template",
                                       "volumeClaimTemplates"],
        "properties": {"selector": SELECTOR, "template": POD_TEMPLATE,
                       "volumeClaimTemplates": {"type": "array", "minItems": 1}}}),
    "ScaledObject": _obj("keda.sh/v1alpha1", "ScaledObject", {
        "type": "object", "required": ["scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                                       "triggers"],
        "properties": {
            "scaleTargetRef": {"type": "object", "required": ["name"],
                               "properties": {"name": NAME}},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "metadata"],
                "properties": {
                    "type": {"const": "redis"},
                    "metadata": {
                        "type": "object", "required": ["listName", "listLength"],
                        "properties": {
                            "listName": {"enum": [lane for pool in POOLS
                                                  for lane in lanes(pool)]},
                            "listLength": {"type": "string", "pattern": r"^[1-9][0-9]*$"},
                            "activationListLength": {"type": "string", "pattern": r"^[0-9]+$"},
                            "databaseIndex": {"type": "string", "pattern": r"^[0-9]+$"}}},
                    "authenticationRef": {"type": "object", "required": ["name"]}}}}}}),
    "TriggerAuthentication": _obj("keda.sh/v1alpha1", "TriggerAuthentication", {
        "type": "object", "required": ["secretTargetRef"],
        "properties": {"secretTargetRef": {"type": "array", "items": {
            "type": "object", "required": ["parameter", "name", "key"]}}}}),
}

# --------------------------------------------------------------------------- loading


def _documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: no YAML documents"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"
    return docs


def _k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in _documents(path)]


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")]


def _pool_of(deployment: dict[str, Any]) -> str | None:
    argv = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    if "--pool" in argv:
        return argv[argv.index("--pool") + 1]
    return None


# --------------------------------------------------------------------------- Kubernetes


def test_every_yaml_file_parses() -> None:
    files = [COMPOSE, COMPOSE_SENTINEL, *sorted(K8S.glob("*.yaml")),
             *sorted(K8S_SENTINEL.glob("*.yaml"))]
    assert len(files) >= 11
    for path in files:
        _documents(path)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = _documents(K8S / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    assert "redis.yaml" in listed  # the optional StatefulSet is its own file


def test_k8s_objects_match_their_schema() -> None:
    objects = _k8s_objects()
    for obj in objects:
        assert obj.get("kind") in SCHEMAS, f"no schema for kind {obj.get('kind')!r}"
        jsonschema.validate(obj, SCHEMAS[obj["kind"]])
        assert obj["metadata"].get("namespace", "cortex") == "cortex"
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate objects"


def test_a_deployment_per_pool_and_the_api() -> None:
    deployments = _by_kind(_k8s_objects(), "Deployment")
    pools = {_pool_of(d): name for name, d in deployments.items() if _pool_of(d)}
    assert set(pools) == set(POOLS)
    api = deployments["cortex-api"]["spec"]["template"]["spec"]["containers"][0]
    assert api["command"][:2] == ["cortex", "api"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # `cortex api` on 0.0.0.0 needs API keys; the Secret's entries must parse.
    keys = next(e for e in api["env"] if e["name"] == "CORTEX_API_KEYS")["valueFrom"]
    secret = _by_kind(_k8s_objects(), "Secret")[keys["secretKeyRef"]["name"]]
    assert hashed_key_entries(secret["stringData"][keys["secretKeyRef"]["key"]])
    for deployment in deployments.values():
        spec = deployment["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    # Only the docker pool gets the Docker socket.
    for name, pod in _pod_specs(_k8s_objects()):
        sockets = [v for v in pod.get("volumes", [])
                   if v.get("hostPath", {}).get("path") == "/var/run/docker.sock"]
        assert bool(sockets) == (name == pools["docker"]), name


def test_references_between_objects_resolve() -> None:
    objects = _k8s_objects()
    config_maps = _by_kind(objects, "ConfigMap")
    secrets = _by_kind(objects, "Secret")
    claims = _by_kind(objects, "PersistentVolumeClaim")
    for name, pod in _pod_specs(objects):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, name
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name
        claim_templates = {"data"} if name == "cortex-redis" else set()
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claim_templates, (name, mount)
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, name
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (name, ref)
            ports = {p.get("name") for p in container.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = container.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str):
                    assert port in ports, (name, probe, port)
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    for service in _by_kind(objects, "Service").values():
        selector = service["spec"]["selector"].items()
        targets = [w for w in workloads
                   if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, service["metadata"]["name"]


def test_settings_in_the_config_map_are_settings() -> None:
    config = _by_kind(_k8s_objects(), "ConfigMap")["cortex-config"]["data"]
    for key in config:
        assert key.startswith("CORTEX_")
        assert key.removeprefix("CORTEX_").lower() in Settings.model_fields, key


def test_the_example_manifests_config_map_loads(tmp_path: Path) -> None:
    data = _by_kind(_k8s_objects(), "ConfigMap")["cortex-manifests"]["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    registry = load_registry(tmp_path)
    assert registry.tools


def test_keda_scales_each_pool_on_every_lane_of_its_queue() -> None:
    """KEDA's `redis` trigger reads one list, and a pool's backlog is spread over its lanes'
    lists (each tenant's in its own): a ScaledObject has a trigger per lane, or it would not
    see most tenants' work."""
    objects = _k8s_objects()
    deployments = _by_kind(objects, "Deployment")
    auths = _by_kind(objects, "TriggerAuthentication")
    secrets = _by_kind(objects, "Secret")
    scaled = _by_kind(objects, "ScaledObject")
    seen = set()
    for name, obj in scaled.items():
        target = obj["spec"]["scaleTargetRef"]["name"]
        assert target in deployments, name
        triggers = obj["spec"]["triggers"]
        pool = triggers[0]["metadata"]["listName"]
        assert pool in POOLS
        assert _pool_of(deployments[target]) == pool, f"{name} scales {target} on {pool}"
        listed = [t["metadata"]["listName"] for t in triggers]
        assert sorted(listed) == sorted(lanes(pool)), f"{name}: not every lane of {pool}"
        assert obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
        url = secrets["cortex-secrets"]["stringData"]["redis-url"]
        db = re.search(r"/(\d+)$", url)
        for trigger in triggers:
            assert trigger["type"] == "redis"
            auth = auths[trigger["authenticationRef"]["name"]]
            for ref in auth["spec"]["secretTargetRef"]:
                assert ref["key"] in secrets[ref["name"]]["stringData"]
            assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} >= {"address"}
            # KEDA reads the lists from the database the workers use.
            assert trigger["metadata"].get("databaseIndex", "0") == (db.group(1) if db else "0")
        # one target per pool: every lane's trigger asks the same backlog per replica
        assert len({t["metadata"]["listLength"] for t in triggers}) == 1, name
        seen.add(pool)
    assert seen == set(POOLS)
    relic = next(o for o in scaled.values()
                 if o["spec"]["triggers"][0]["metadata"]["listName"] == "relic")
    assert relic["spec"]["maxReplicaCount"] == 1  # relic state lives in one pod


def test_redis_statefulset_uses_aof_on_a_volume() -> None:
    redis = _by_kind(_k8s_objects(), "StatefulSet")["cortex-redis"]
    container = redis["spec"]["template"]["spec"]["containers"][0]
    argv = container["command"]
    assert argv[argv.index("--appendonly") + 1] == "yes"
    assert argv[argv.index("--appendfsync") + 1] == "everysec"
    data = argv[argv.index("--dir") + 1]
    assert any(m["mountPath"] == data for m in container["volumeMounts"])
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


# --------------------------------------------------------------------------- Sentinel


def _sentinel_overlay() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The overlay's kustomization and its own objects."""
    kustomization = _documents(K8S_SENTINEL / "kustomization.yaml")[0]
    own = [doc for name in kustomization["resources"] if name != "../k8s"
           for doc in _documents(K8S_SENTINEL / name)]
    return kustomization, own


def _patched_secret(kustomization: dict[str, Any]) -> dict[str, str]:
    patches = [yaml.safe_load(p["patch"]) for p in kustomization["patches"]]
    secret = next(p for p in patches if p["kind"] == "Secret" and "$patch" not in p)
    return secret["stringData"]


def test_the_sentinel_overlay_replaces_the_single_redis() -> None:
    """deploy/k8s-sentinel: the base without its Redis, plus two nodes and three sentinels,
    and a Secret whose URL names those sentinels and the master they monitor."""
    kustomization, own = _sentinel_overlay()
    assert kustomization["resources"][0] == "../k8s"
    assert {p.name for p in K8S_SENTINEL.glob("*.yaml")} - {"kustomization.yaml"} == set(
        kustomization["resources"][1:])
    for obj in own:
        jsonschema.validate(obj, SCHEMAS[obj["kind"]])
    deleted = {(p["kind"], p["metadata"]["name"]) for p in
               (yaml.safe_load(x["patch"]) for x in kustomization["patches"]) if "$patch" in p}
    base = {(o["kind"], o["metadata"]["name"]) for o in _k8s_objects()}
    assert deleted == {("StatefulSet", "cortex-redis"), ("Service", "cortex-redis")} and deleted <= base
    names = [(o["kind"], o["metadata"]["name"]) for o in own]
    assert not set(names) & (base - deleted), "an overlay object has a base object's name"

    secret = _patched_secret(kustomization)
    target = parse_url(secret["redis-url"])
    assert isinstance(target, SentinelTarget)
    sets = _by_kind(own, "StatefulSet")
    sentinels = sets["cortex-sentinel"]
    assert sentinels["spec"]["replicas"] == len(target.sentinels) == 3
    service = sentinels["spec"]["serviceName"]
    assert {host for host, _ in target.sentinels} == {
        f"cortex-sentinel-{i}.{service}" for i in range(3)}
    assert {port for _, port in target.sentinels} == {26379}
    scripts = _by_kind(own, "ConfigMap")["cortex-redis-ha-scripts"]["data"]
    assert f"sentinel monitor {target.master_name} $master 6379 2" in scripts["sentinel.sh"]
    assert sets["cortex-redis-ha"]["spec"]["replicas"] == 2
    # KEDA reads the queues through a Service of the overlay.
    host = secret["redis-address"].rsplit(":", 1)[0]
    assert host in _by_kind(own, "Service")


def test_kustomize_builds_the_sentinel_overlay() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(K8S_SENTINEL)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d]
    names = {(o["kind"], o["metadata"]["name"]) for o in built}
    assert ("StatefulSet", "cortex-redis") not in names
    assert {("StatefulSet", "cortex-redis-ha"), ("StatefulSet", "cortex-sentinel")} <= names
    secret = _by_kind(built, "Secret")["cortex-secrets"]["stringData"]
    assert secret["redis-url"].startswith("redis+sentinel://")


def test_the_sentinel_compose_file_points_every_process_at_the_sentinels() -> None:
    base = _compose()["services"]
    override = _documents(COMPOSE_SENTINEL)[0]["services"]
    cortex = {name for name, service in base.items()
              if "CORTEX_REDIS_URL" in service.get("environment", {})}
    assert cortex >= {"api", "flower", *(f"worker-{p}" for p in POOLS)}
    urls = {override[name]["environment"]["CORTEX_REDIS_URL"] for name in cortex}
    assert len(urls) == 1
    target = parse_url(urls.pop())
    assert isinstance(target, SentinelTarget)
    for host, port in target.sentinels:
        assert host in override and port == 26379, host
        assert f"sentinel monitor {target.master_name} redis 6379 2" in "".join(
            override[host]["command"])
    replica = override["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1] == "redis"


# --------------------------------------------------------------------------- compose


def _compose() -> dict[str, Any]:
    return _documents(COMPOSE)[0]


def test_compose_has_a_service_per_pool_redis_with_aof_and_flower_with_auth() -> None:
    services = _compose()["services"]
    pools = {}
    for name, service in services.items():
        argv = service.get("command", [])
        if argv[:2] == ["cortex", "worker"]:
            pools[argv[argv.index("--pool") + 1]] = name
    assert set(pools) == set(POOLS)
    assert services["api"]["command"][:2] == ["cortex", "api"]
    # `cortex api` on 0.0.0.0 needs API keys: the file demands them rather than run open.
    assert ":?" in services["api"]["environment"]["CORTEX_API_KEYS"]

    redis = services["redis"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert redis["command"][redis["command"].index("--appendfsync") + 1] == "everysec"
    assert any(v.endswith(":/data") for v in redis["volumes"])

    flower = services["flower"]
    assert flower["command"][:4] == ["celery", "-A", "cortex_worker.app", "flower"]
    assert "FLOWER_BASIC_AUTH" in flower["environment"]
    assert ":?" in flower["environment"]["FLOWER_BASIC_AUTH"]  # required, no default
    assert not any("basic" in part for part in flower["command"])  # not on the command line

    for pool, name in pools.items():
        assert services[name]["environment"]["CORTEX_REDIS_URL"].startswith("redis://redis:")
        mounts = services[name]["volumes"]
        assert any(m.endswith(":/etc/cortex/manifests:ro") for m in mounts)
        assert any("docker.sock" in m for m in mounts) == (pool == "docker"), name
        assert "ping" in " ".join(services[name]["healthcheck"]["test"])


def _compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=30, check=False).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_config_accepts_the_file() -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` (the plugin) nor `docker-compose` is installed")
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "FLOWER_BASIC_AUTH": "ops:secret",
           "CORTEX_API_KEYS": "ops:0123456789abcdef0123", "HOME": str(DEPLOY)}
    done = subprocess.run([*command, "-f", str(COMPOSE), "config"], cwd=DEPLOY, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert {f"worker-{p}" for p in POOLS} <= set(resolved["services"])
    assert resolved["services"]["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "ops:secret"
    # Without the Flower password the file is refused rather than run without auth.
    env.pop("FLOWER_BASIC_AUTH")
    refused = subprocess.run([*command, "-f", str(COMPOSE), "config"], cwd=DEPLOY, env=env,
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0
    assert "FLOWER_BASIC_AUTH" in refused.stderr + refused.stdout


# --------------------------------------------------------------------------- Dockerfile


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in lines if line and not line.startswith("#")]


def test_dockerfile_runs_as_a_user_and_has_a_healthcheck() -> None:
    instructions = _instructions()
    kinds = [kind for kind, _ in instructions]
    assert instructions[0] == ("FROM", "python:3.11-slim")
    users = [arg for kind, arg in instructions if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    health = [arg for kind, arg in instructions if kind == "HEALTHCHECK"]
    assert len(health) == 1 and "/healthz" in health[0]
    cmd = [arg for kind, arg in instructions if kind == "CMD"][-1]
    assert cmd.startswith('["cortex", "api"')


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].removesuffix("/**") for line in ignore if line.startswith("!")}
    for kind, arg in _instructions():
        if kind == "COPY":
            for source in arg.split()[:-1]:
                assert source in kept, source
                assert (DEPLOY.parent / source).exists(), source
