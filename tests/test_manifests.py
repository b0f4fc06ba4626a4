"""The cluster manifests (docker/compose.yaml, docker/mpijob.yaml) against schemas, and against
the image they run (docker/Dockerfile, its entrypoint and ssh settings). No cluster and no container
engine are needed: kubectl --dry-run=client asks a server for its API, and kubeconform is in no
package registry, so the Kubernetes objects are checked with kubernetes-validate (the API's own
JSON schemas, strict: unknown fields fail), the MPIJob's own fields with a schema written from the
MPI Operator's v2beta1 types (pkg/apis/kubeflow/v2beta1/types.go), and the compose file with the
Compose Specification's schema (check-jsonschema's copy). docker/test-image.sh runs the image."""
import copy
import os
import re
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")
KUBERNETES = "1.32.0"  # the oldest Kubernetes the MPI Operator's current release supports

STRING = {"type": "string"}
INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
REPLICA = {"type": "object", "additionalProperties": False, "required": ["template"], "properties": {
    "replicas": INT32, "template": {"type": "object"},
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]}}}
MPIJOB = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v2beta1"}, "kind": {"const": "MPIJob"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["mpiReplicaSpecs"], "properties": {
            "slotsPerWorker": {**INT32, "minimum": 1},
            "runLauncherAsWorker": {"type": "boolean"},
            "runPolicy": {"type": "object", "additionalProperties": False, "properties": {
                "cleanPodPolicy": {"enum": ["", "All", "Running", "None"]},
                "ttlSecondsAfterFinished": INT32, "activeDeadlineSeconds": {"type": "integer", "minimum": 0},
                "backoffLimit": INT32, "schedulingPolicy": {"type": "object"}, "suspend": {"type": "boolean"},
                "managedBy": STRING}},
            "mpiReplicaSpecs": {"type": "object", "additionalProperties": False, "required": ["Launcher", "Worker"],
                                "properties": {"Launcher": REPLICA, "Worker": REPLICA}},
            "sshAuthMountPath": STRING,
            "launcherCreationPolicy": {"enum": ["AtStartup", "WaitForWorkersReady"]},
            "mpiImplementation": {"enum": ["OpenMPI", "Intel", "MPICH"]}}}}}


def load_mpijob():
    with open(os.path.join(DOCKER, "mpijob.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return {d["kind"]: d for d in docs}


def check_mpijob(objects):
    """Every object of the manifest against its schema; raises on the first problem."""
    for kind, obj in objects.items():
        if kind == "MPIJob":
            jsonschema.validate(obj, MPIJOB)
            for role, replica in obj["spec"]["mpiReplicaSpecs"].items():
                # A replica's template is a core PodTemplateSpec: Kubernetes' own schema, strictly.
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": role.lower()}, "template": replica["template"]},
                                             KUBERNETES, strict=True)
        else:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def dockerfile_uid():
    text = open(os.path.join(DOCKER, "Dockerfile")).read()
    return int(re.search(r"^ARG UID=(\d+)$", text, re.M).group(1))


def ssh_ports():
    """The port the image's sshd listens on and the one its ssh client calls."""
    sshd = re.search(r"^Port (\d+)$", open(os.path.join(DOCKER, "sshd_config")).read(), re.M).group(1)
    client = re.search(r"^\s+Port (\d+)$", open(os.path.join(DOCKER, "ssh_config")).read(), re.M).group(1)
    return int(sshd), int(client)


def entrypoint_roles():
    text = open(os.path.join(DOCKER, "entrypoint.sh")).read()
    return set(re.findall(r"^  ([a-z-]+)\)$", text, re.M))


def test_the_mpijob_manifest_passes_the_schemas():
    objects = load_mpijob()
    assert set(objects) == {"MPIJob", "PersistentVolumeClaim"}
    check_mpijob(objects)


@pytest.mark.parametrize("damage", [
    ("spec", "slotsPerWorker", "one"),                                       # not an integer
    ("spec", "mpiImplementation", "OpenMPI5"),                               # not one the operator knows
    ("spec", "runPolicy", {"cleanPolicy": "Running"}),                       # a misspelt field
    ("spec", "mpiReplicaSpecs", {"Worker": {"replicas": 2, "template": {}}}),  # no launcher
    ("workerContainer", "resource", {}),                                      # not a container field
    ("workerContainer", "args", "sshd"),                                      # a string, not a list
])
def test_the_schemas_catch_a_damaged_mpijob(damage):
    objects = copy.deepcopy(load_mpijob())
    where, field, value = damage
    spec = objects["MPIJob"]["spec"]
    target = spec if where == "spec" else spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    target[field] = value
    with pytest.raises(jsonschema.ValidationError):
        check_mpijob(objects)


def test_the_mpijob_runs_the_image_as_built():
    objects = load_mpijob()
    job = objects["MPIJob"]["spec"]
    launcher, worker = job["mpiReplicaSpecs"]["Launcher"], job["mpiReplicaSpecs"]["Worker"]
    assert launcher["replicas"] == 1
    (lc,), (wc,) = launcher["template"]["spec"]["containers"], worker["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in lc["env"]}
    # The ranks asked for fill the operator's hostfile exactly: a slot per rank.
    assert int(env["SHARDREC_NP"]) == worker["replicas"] * job["slotsPerWorker"] == 2
    assert lc["args"][0] == "demo" and lc["args"][1:3] == ["--hostfile", "/etc/mpi/hostfile"]
    assert wc["args"] == ["sshd"] and {"demo", "sshd"} <= entrypoint_roles()
    assert job["mpiImplementation"] == "OpenMPI" and job["runPolicy"]["backoffLimit"] == 0
    assert job["sshAuthMountPath"] == "/home/shardrec/.ssh"
    assert lc["image"] == wc["image"]
    pvc = objects["PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod writes its rank's shard
    uid = dockerfile_uid()
    for replica, container in ((launcher, lc), (worker, wc)):
        pod = replica["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == uid != 0 and pod["securityContext"]["fsGroup"] == uid
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/checkpoints"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), (container["name"], kind)


def load_compose():
    with open(os.path.join(DOCKER, "compose.yaml")) as f:
        return yaml.safe_load(f)


def compose_schema_check(path):
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", path],
                          capture_output=True, text=True)


def test_the_compose_file_passes_the_compose_specification(tmp_path):
    proc = compose_schema_check(os.path.join(DOCKER, "compose.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The same check fails a damaged copy (a misspelt service field).
    damaged = load_compose()
    damaged["services"]["launcher"]["comand"] = damaged["services"]["launcher"].pop("command")
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(damaged))
    proc = compose_schema_check(str(path))
    assert proc.returncode != 0 and "comand" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_compose_file_runs_the_job_on_two_workers_with_a_shared_checkpoint_volume():
    compose = load_compose()
    services = compose["services"]
    workers = sorted(name for name in services if name.startswith("worker-"))
    assert workers == ["worker-1", "worker-2"]
    launcher = services["launcher"]
    command = launcher["command"]
    assert command[0] == "demo" and set(s["command"][0] for s in services.values()) <= entrypoint_roles()
    hosts = dict(h.split(":") for h in command[command.index("-H") + 1].split(","))
    assert sorted(hosts) == workers and sum(map(int, hosts.values())) == int(launcher["environment"]["SHARDREC_NP"])
    sshd_port, client_port = ssh_ports()
    assert sshd_port == client_port
    for name in workers:
        worker = services[name]
        assert worker["hostname"] == name and worker["command"] == ["sshd"]
        assert f"'localhost', {sshd_port}" in " ".join(worker["healthcheck"]["test"])
        assert launcher["depends_on"][name]["condition"] == "service_healthy"
    for name in workers + ["launcher"]:
        mounts = dict(v.split(":") for v in services[name]["volumes"])
        assert mounts["checkpoints"] == "/checkpoints" and mounts["ssh"] == "/home/shardrec/.ssh", name
        assert "limits" in services[name]["deploy"]["resources"], name
    assert set(compose["volumes"]) == {"ssh", "checkpoints"} and set(services) == {"launcher", *workers}
    build = launcher["build"]
    assert os.path.isfile(os.path.join(DOCKER, build["context"], build["dockerfile"]))
