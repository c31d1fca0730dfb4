"""deploy/kubernetes: every layout and component renders (`kubectl kustomize`) into objects Kubernetes' own schemas
accept (kubernetes-validate, offline), and what the manifests assume of vlserve holds: each role's args parse with
the real CLI, its probes and metrics hit --port on routes its app really serves (with the liveness / readiness
split the probes rely on), Services select the pods they front, every Secret / ConfigMap / PVC a pod names exists
or is documented, and --registry names the etcd Service. Nothing is applied to a cluster.

The rendering tests skip where kubectl (with its embedded kustomize v5, kubectl >= 1.27) is missing or too old."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace as NS

import kubernetes_validate
import pytest
import yaml

from vlserve.cli import build_parser
from vlserve.core.options import options_from, role_fields
from vlserve.disagg.registry import parse_registry_url, registry_namespace

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are checked against
MIN_KUSTOMIZE = (5, 0)
ROLES = {"encoder": "encode", "language": "language", "prefill": "prefill", "decode": "decode"}  # label -> command
LAYOUTS = {"e-pd": {"encoder", "language"}, "e-p-d": {"encoder", "prefill", "decode"}}
API_ROLE = {"e-pd": "language", "e-p-d": "decode"}
COMPONENTS = ("gpu", "external-etcd", "etcd-auth", "models-hostpath")
EXTERNAL_REGISTRY = "etcd://etcd-0.etcd.infra:2379,etcd-1.etcd.infra:2379"  # what a user's kustomization sets
POD_IP, SECRET, ETCD_USER = "10.1.2.3", "test-secret", "vlserve-user"  # what the kubelet would fill in


@dataclasses.dataclass(frozen=True)
class Variant:
    layout: str
    components: tuple[str, ...] = ()
    folder: str | None = None  # a shipped kustomization rendered as it is (else one is written for the variant)

    @property
    def id(self) -> str:
        return self.folder or "+".join((self.layout, *self.components))


VARIANTS = ([Variant(layout) for layout in LAYOUTS] + [Variant(layout, (c,)) for layout in LAYOUTS for c in COMPONENTS]
            + [Variant(layout, COMPONENTS) for layout in LAYOUTS] + [Variant("e-pd", folder="example")])


# ---- rendering --------------------------------------------------------------------------------------------------
@functools.cache
def kubectl_problem() -> str | None:
    """Why `kubectl kustomize` cannot render these manifests here, or None."""
    exe = shutil.which("kubectl")
    if exe is None:
        return "kubectl is not installed (kubectl >= 1.27 embeds the kustomize v5 these manifests need)"
    out = subprocess.run([exe, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    try:
        info = json.loads(out.stdout)
    except json.JSONDecodeError:
        return f"`kubectl version --client -o json` gave no JSON: {out.stderr.strip()[:200]}"
    found = info.get("kustomizeVersion") or ""
    version = tuple(int(p) for p in re.findall(r"\d+", found)[:2])
    if version < MIN_KUSTOMIZE:
        client = info.get("clientVersion", {}).get("gitVersion", "?")
        return (f"kubectl {client} embeds kustomize {found or '< v4'}; these manifests need v{MIN_KUSTOMIZE[0]} "
                "(kubectl >= 1.27; Debian's kubernetes-client 1.20 is too old)")
    return None


@functools.cache
def render(variant: Variant) -> tuple[dict, ...]:
    if (problem := kubectl_problem()) is not None:
        pytest.skip(problem)
    with tempfile.TemporaryDirectory() as tmp:
        folder = KUBE / variant.folder if variant.folder else Path(tmp)
        if not variant.folder:  # the kustomization a user writes (example/kustomization.yaml)
            rel = os.path.relpath(KUBE, tmp)  # kustomize refuses absolute paths
            doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                   "resources": [f"{rel}/overlays/{variant.layout}"],
                   "components": [f"{rel}/components/{c}" for c in variant.components]}
            if "external-etcd" in variant.components:
                doc["patches"] = [{"patch": yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                                           "metadata": {"name": "vlserve-config"},
                                                           "data": {"registry": EXTERNAL_REGISTRY}})}]
            (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc))
        out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {variant.id} failed: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@pytest.fixture(params=VARIANTS, ids=lambda v: v.id)
def variant(request) -> Variant:
    return request.param


# ---- reading rendered objects -----------------------------------------------------------------------------------
def of_kind(objs, kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def named(objs, kind: str, name: str) -> dict | None:
    return next((o for o in of_kind(objs, kind) if o["metadata"]["name"] == name), None)


def workloads(objs) -> list[dict]:
    return of_kind(objs, "Deployment") + of_kind(objs, "StatefulSet")


def role_deployments(objs) -> dict[str, dict]:
    """component label -> Deployment, for vlserve's roles."""
    out = {}
    for d in of_kind(objs, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/name") == "vlserve":
            out[labels["app.kubernetes.io/component"]] = d
    return out


def only_container(w: dict) -> dict:
    containers = w["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{w['metadata']['name']}: one container expected"
    return containers[0]


def port_number(container: dict, port) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert numbers, f"container {container['name']} has no port named {port!r}"
    return numbers[0]


def env_values(container: dict, objs) -> dict[str, str]:
    """The container's environment as the kubelet would set it (Secrets' values stand in)."""
    values = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            values[e["name"]] = e["value"]
        elif "configMapKeyRef" in ref:
            cm = named(objs, "ConfigMap", ref["configMapKeyRef"]["name"])
            values[e["name"]] = cm["data"][ref["configMapKeyRef"]["key"]]  # test_references_resolve checks
        elif "secretKeyRef" in ref:
            values[e["name"]] = ETCD_USER if ref["secretKeyRef"]["key"] == "user" else SECRET
        elif "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "status.podIP", e
            values[e["name"]] = POD_IP
        elif "resourceFieldRef" in ref:  # e.g. limits.cpu (divisor 1)
            kind, resource = ref["resourceFieldRef"]["resource"].split(".", 1)
            values[e["name"]] = str(container["resources"][kind][resource])
    return values


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of args ($$ escapes; an unknown name stays as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


@dataclasses.dataclass
class Role:
    component: str
    command: str
    deployment: dict
    container: dict
    args: list[str]
    opts: object


def parse_roles(objs, monkeypatch) -> dict[str, Role]:
    """Each role's args through vlserve's own parser and option resolution, in its container's environment."""
    roles = {}
    for component, dep in role_deployments(objs).items():
        c = only_container(dep)
        env = env_values(c, objs)
        args = [expand(a, env) for a in c["args"]]
        assert not any("$(" in a for a in args), f"{component}: args name a variable its env lacks: {args}"
        assert "command" not in c, f"{component}: the image's ENTRYPOINT (vlserve) runs the role"
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{component}: `vlserve {' '.join(args)}` is refused: {err.getvalue().strip()}")
        command = ROLES[component]
        assert ns.command == command, f"{component} runs `vlserve {ns.command}`"
        with monkeypatch.context() as m:  # vlserve reads its VLSERVE_* variables from the process environment
            for name in [n for n in os.environ if n.startswith("VLSERVE_")]:
                m.delenv(name)
            for name, value in env.items():
                m.setenv(name, value)
            opts = options_from(ns, command)
        roles[component] = Role(component, command, dep, c, args, opts)
    return roles


def role_envs(command: str) -> set[str]:
    return {f.metadata["env"] for _, _, f in role_fields(command) if f.metadata.get("env")}


# ---- tests ------------------------------------------------------------------------------------------------------
def test_objects_pass_kubernetes_schemas(variant):
    objs = render(variant)
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(map(str, e.path))
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} ({variant.id}): {path}: {e.message}")
    assert set(role_deployments(objs)) == LAYOUTS[variant.layout]
    external = "external-etcd" in variant.components
    assert (named(objs, "StatefulSet", "vlserve-etcd") is None) == external
    assert (named(objs, "PersistentVolumeClaim", "vlserve-models") is None) == ("models-hostpath" in variant.components)


def test_role_args_parse_and_ports_agree(variant, monkeypatch):
    objs = render(variant)
    roles = parse_roles(objs, monkeypatch)
    for component, role in roles.items():
        server, d, c = role.opts.server, role.opts.disagg, role.container
        meta = role.deployment["spec"]["template"]["metadata"]
        assert server.host == "0.0.0.0", f"{component} must bind every interface in its pod"
        assert port_number(c, "http") == server.port, f"{component}: containerPort http is not --port"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert port_number(c, c[probe]["httpGet"]["port"]) == server.port, f"{component} {probe} misses --port"
        assert meta["annotations"]["prometheus.io/scrape"] == "true"
        assert meta["annotations"]["prometheus.io/port"] == str(server.port), f"{component}: metrics are on --port"
        if role.command in ("encode", "prefill"):  # peers dial their data port (found in etcd by pod IP)
            data_port = d.data_port or server.port + 1
            assert port_number(c, "data") == data_port, f"{component}: containerPort data is not --data-port"
            svc = named(objs, "Service", role.deployment["metadata"]["name"])
            assert [p["port"] for p in svc["spec"]["ports"] if p["name"] == "data"] == [data_port], component
        # the VLSERVE_* names are the ones vlserve reads, so the values arrived:
        assert {n for n in env_values(c, objs) if n.startswith("VLSERVE_")} <= role_envs(role.command)
        assert d.advertise_host == POD_IP and d.disagg_secret == SECRET
        if "etcd-auth" in variant.components:
            assert (d.registry_user, d.registry_password) == (ETCD_USER, SECRET)
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["models"]["readOnly"] is True
        assert role.opts.engine.model.startswith(mounts["models"]["mountPath"].rstrip("/") + "/"), \
            f"{component}: --model {role.opts.engine.model} is not on the models volume"
    # etcd's key namespace comes from --model: every role must land in the same one
    assert len({registry_namespace(r.opts.disagg, r.opts.engine.model) for r in roles.values()}) == 1


class _Engine(NS):
    """What the API and prefill apps read of an engine for /health, /ready and /metrics."""

    def __init__(self, ready: bool):
        super().__init__(model_name="m", is_healthy=True, unhealthy_reason=None,
                         not_ready_reason=None if ready else "no peer is paired",
                         metrics=NS(render=lambda: b"vlserve:num_requests_running 0\n"),
                         cfg=NS(limit_mm_per_prompt={"image": 8}))  # (the playground's config reads it)


def role_app(command: str, ready: bool):
    """The real HTTP app of a role around a stand-in engine (routes and probe answers only; no model loads)."""
    if command in ("language", "decode"):
        from vlserve.core.config import ServerArgs
        from vlserve.server.api_server import build_app

        return build_app(_Engine(ready), ServerArgs())
    if command == "prefill":
        from vlserve.disagg.prefill_service import PrefillService

        return PrefillService.http_app(NS(engine=_Engine(ready)))
    from prometheus_client import CollectorRegistry

    from vlserve.disagg.encode_service import EncodeService

    # an encoder is ready once it answers; only a lost tensor-parallel rank (tower.failure) makes it unhealthy
    return EncodeService.http_app(NS(tower=NS(failure=None if ready else "rank 1 died"),
                                     registry=CollectorRegistry()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_probe_paths_are_routes_with_the_right_meaning(layout, monkeypatch):
    from fastapi.testclient import TestClient

    for component, role in parse_roles(render(Variant(layout)), monkeypatch).items():
        c = role.container
        ready_path, live_path = c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]
        metrics_path = role.deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
        paths = {ready_path, live_path, metrics_path, c["startupProbe"]["httpGet"]["path"]}
        app = role_app(role.command, ready=True)
        served = {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}
        assert paths <= served, f"{component} probes {sorted(paths - served)}, which `vlserve {role.command}` lacks"
        with TestClient(app) as client:
            assert all(client.get(p).status_code == 200 for p in paths), f"{component}: a ready role answers 200"
        with TestClient(role_app(role.command, ready=False)) as client:
            if role.command == "encode":  # a dead tower: restart it
                assert client.get(live_path).status_code == 503
            else:  # no peer yet: out of the Service, but never restarted for it (liveness stays 200)
                assert client.get(ready_path).status_code == 503
                assert client.get(live_path).status_code == 200, f"{component}: liveness must not wait for peers"


def test_the_api_role_drains_its_requests_within_the_grace_period(variant, monkeypatch):
    """On SIGTERM the API role lets its requests in flight finish for --shutdown-timeout seconds (0, the default,
    cuts them at once); the kubelet kills it terminationGracePeriodSeconds after SIGTERM, so the drain ends
    before that, with time left to exit."""
    role = parse_roles(render(variant), monkeypatch)[API_ROLE[variant.layout]]
    grace = role.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = role.opts.server.shutdown_timeout
    assert 0 < drain and drain + 10 <= grace, f"{role.component}: --shutdown-timeout {drain}, grace period {grace}s"


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_services_select_their_pods(variant):
    objs = render(variant)
    deps = role_deployments(objs)
    expected = {"vlserve-api": {deps[API_ROLE[variant.layout]]["metadata"]["name"]},
                "vlserve-encoder": {"vlserve-encoder"}, "vlserve-prefill": {"vlserve-prefill"},
                "vlserve-etcd": {"vlserve-etcd"}}
    for w in workloads(objs):
        assert selects(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"]), \
            f"{w['metadata']['name']} does not select its own pods"
    services = of_kind(objs, "Service")
    assert "vlserve-api" in {s["metadata"]["name"] for s in services}
    for svc in services:
        name = svc["metadata"]["name"]
        picked = [w for w in workloads(objs) if selects(svc["spec"]["selector"],
                                                          w["spec"]["template"]["metadata"]["labels"])]
        names = {w["metadata"]["name"] for w in picked}
        assert names == expected[name], f"Service {name} selects {sorted(names)}, not {sorted(expected[name])}"
        for w in picked:
            c = w["spec"]["template"]["spec"]["containers"][0]
            for p in svc["spec"]["ports"]:
                port_number(c, p.get("targetPort", p["port"]))  # every Service port lands on a container port
    api = named(objs, "Service", "vlserve-api")
    api_port = api["spec"]["ports"][0]
    assert api["spec"].get("type", "ClusterIP") == "ClusterIP" and api["spec"].get("clusterIP") != "None"
    assert port_number(only_container(deps[API_ROLE[variant.layout]]), api_port["targetPort"]) == 8000


def documented_secrets() -> dict[str, set[str]]:
    """Secrets the user creates (secret.example.yaml): name -> keys."""
    docs = yaml.safe_load_all((KUBE / "secret.example.yaml").read_text())
    return {d["metadata"]["name"]: set(d["stringData"]) for d in docs if d}


def test_references_resolve(variant):
    objs = render(variant)
    documented = documented_secrets()
    rendered_secrets = {s["metadata"]["name"]: set(s.get("data", {})) | set(s.get("stringData", {}))
                        for s in of_kind(objs, "Secret")}
    for w in workloads(objs):
        spec, wname = w["spec"]["template"]["spec"], w["metadata"]["name"]
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    cm = named(objs, "ConfigMap", ref["configMapKeyRef"]["name"])
                    assert cm and ref["configMapKeyRef"]["key"] in cm["data"], f"{wname} {e['name']}: no ConfigMap"
                if "secretKeyRef" in ref:
                    name, key = ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
                    keys = rendered_secrets.get(name, documented.get(name, set()))
                    assert key in keys, f"{wname} {e['name']}: Secret {name}/{key} is neither rendered nor documented"
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert mounted <= set(volumes) | claims, f"{wname} mounts a volume it does not define"
        for v in volumes.values():
            assert len(set(v) - {"name"}) == 1, f"{wname}: volume {v['name']} has several sources: {v}"
            if "persistentVolumeClaim" in v:
                assert named(objs, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]), v
    if "models-hostpath" in variant.components:
        for dep in role_deployments(objs).values():
            models = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
            assert models["hostPath"]["path"].startswith("/")
    else:
        pvc = named(objs, "PersistentVolumeClaim", "vlserve-models")
        assert set(pvc["spec"]["accessModes"]) <= {"ReadOnlyMany", "ReadWriteMany"}, "every role pod mounts it"


@pytest.mark.parametrize("name", ["secret.example.yaml", "models-loader.yaml"])
def test_files_applied_by_hand_pass_kubernetes_schemas(name):
    docs = [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if name == "models-loader.yaml":  # it writes where the roles read
        claim = docs[0]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
        assert claim == yaml.safe_load((KUBE / "base" / "models-pvc.yaml").read_text())["metadata"]["name"]


def test_unchanged_secret_example_never_works(monkeypatch):
    """secret.example.yaml ships no usable secret: applied as it is, every role refuses to start (the roles need
    the secret on any address)."""
    from vlserve.core.errors import InvalidInputError
    from vlserve.disagg.auth import PeerAuth, require_secret

    value = documented_secrets()["vlserve-disagg"]
    assert value == {"secret"}
    example = next(d for d in yaml.safe_load_all((KUBE / "secret.example.yaml").read_text())
                   if d and d["metadata"]["name"] == "vlserve-disagg")
    monkeypatch.setenv("VLSERVE_DISAGG_SECRET", example["stringData"]["secret"])
    opts = options_from(build_parser().parse_args(["encode", "--model", "/models/m", "--host", "0.0.0.0"]), "encode")
    with pytest.raises(InvalidInputError, match="needs the deployment's shared secret"):
        require_secret(PeerAuth(opts.disagg.disagg_secret), "an encoder")


def test_registry_names_the_etcd_service(variant, monkeypatch):
    objs = render(variant)
    urls = {r.opts.disagg.registry for r in parse_roles(objs, monkeypatch).values()}
    assert len(urls) == 1, f"the roles meet in different registries: {urls}"
    url = urls.pop()
    target = parse_registry_url(url)
    assert target.kind == "etcd"
    if "external-etcd" in variant.components:
        assert url == EXTERNAL_REGISTRY
        assert not [o for o in objs if "etcd" in o["metadata"]["name"] and o["kind"] != "ConfigMap"]
        return
    svc, sts = named(objs, "Service", "vlserve-etcd"), named(objs, "StatefulSet", "vlserve-etcd")
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "vlserve-etcd"
    etcd = only_container(sts)
    assert etcd["image"].startswith("quay.io/coreos/etcd:v3.5.")
    listen = next(a for a in etcd["args"] if a.startswith("--listen-client-urls="))
    for endpoint in target.endpoints:
        host, port = endpoint.split("://", 1)[1].rsplit(":", 1)
        assert host == "vlserve-etcd" or host.startswith("vlserve-etcd."), f"{url} does not name the etcd Service"
        svc_port = next((p for p in svc["spec"]["ports"] if p["port"] == int(port)), None)
        assert svc_port, f"Service vlserve-etcd has no port {port}"
        target_port = port_number(etcd, svc_port["targetPort"])
        assert listen.endswith(f":{target_port}"), f"etcd listens for clients on {listen}, not {target_port}"


def quantity(text) -> float:
    """A Kubernetes quantity (2, 500m, 8Gi, 1G) as a number."""
    units = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, unit = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text)).groups()
    return float(number) * units[unit]


def test_resources_and_gpu_variant(variant):
    objs = render(variant)
    gpu = "gpu" in variant.components
    roles = set(map(id, role_deployments(objs).values()))
    for w in workloads(objs):
        c, is_role = only_container(w), id(w) in roles
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        for res in ("cpu", "memory"):
            assert quantity(req[res]) <= quantity(lim[res]), f"{w['metadata']['name']}: {res} request > limit"
        shm = [v for v in w["spec"]["template"]["spec"].get("volumes", []) if v.get("emptyDir", {}).get("medium")]
        for v in shm:  # a memory-backed emptyDir counts against the memory limit
            assert quantity(v["emptyDir"]["sizeLimit"]) < quantity(lim["memory"]) / 2
        assert ("nvidia.com/gpu" in lim) == (gpu and is_role), f"{w['metadata']['name']}: GPU limit"
        if is_role:
            assert c["image"] == ("vlserve:cuda" if gpu else "vlserve:latest")
            assert int(lim.get("nvidia.com/gpu", 1)) == 1
            # vlserve sizes its threads from the cgroup quota the CPU limit sets; a hand-set OMP_NUM_THREADS
            # would win over it and give every tensor-parallel rank the whole limit.
            assert "OMP_NUM_THREADS" not in {e["name"] for e in c.get("env", [])}, w["metadata"]["name"]


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_matches_the_manifests():
    text = dockerfile()
    assert re.search(r'^ENTRYPOINT \["vlserve"\]$', text, re.M), "the manifests' args start with the role"
    uid = re.search(r"useradd --uid (\d+)", text).group(1)
    assert re.search(rf"^USER {uid}$", text, re.M)
    pin = re.search(r'"(torch==[^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"pip install --no-cache-dir --index-url \"$index\" {pin}" in text, f"the image installs {pin} first"
    for tag in ("vlserve:latest", "vlserve:cuda"):
        assert f"-t {tag} ." in text, f"the Dockerfile's build commands make {tag}, which the manifests run"
    for path in KUBE.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment":
                ctx = doc["spec"]["template"]["spec"]["securityContext"]
                assert str(ctx["runAsUser"]) == uid and ctx["runAsNonRoot"], f"{path}: run as the image's user"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "!vlserve" in ignored and "!pyproject.toml" in ignored and "!README.md" in ignored


def test_kubectl_problem_names_the_reason(monkeypatch):
    """The skip says what is missing (here: a kubectl whose kustomize is too old)."""
    fake = NS(stdout=json.dumps({"clientVersion": {"gitVersion": "v1.20.2"}}), stderr="", returncode=0)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/kubectl")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: fake)
    kubectl_problem.cache_clear()
    try:
        assert "v1.20.2" in kubectl_problem() and "kustomize" in kubectl_problem()
    finally:
        kubectl_problem.cache_clear()

