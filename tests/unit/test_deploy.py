"""The deployment files: deploy/Dockerfile's three images (cpu, gpu, tpu by ACCELERATOR) and the
Kubernetes JobSets (deploy/jobset-*.yaml) read as Kubernetes would read them (PyYAML), with their
pods, processes, accelerators, node selectors and volumes agreeing, and their training command
parsed by launch.py's own parser and its config loaded. No docker or kubectl is run."""

import re
import shlex

import pytest
import yaml
from support.configs import ROOT

from engine.cli import train as train_cli
from engine.config import load_config

DEPLOY = ROOT / "deploy"


TPU_CHIPS = {"1x1x1": 1, "2x2x1": 4, "2x2x2": 8, "2x2x4": 16, "2x4x4": 32}  # v5p topologies → chips


def _pod(jobset: dict) -> tuple[dict, dict, dict]:
    """(the Job's spec, the pod's spec, its one container) of a JobSet of one replicated job."""
    (job,) = jobset["spec"]["replicatedJobs"]
    job_spec = job["template"]["spec"]
    pod = job_spec["template"]["spec"]
    (container,) = pod["containers"]
    return job_spec, pod, container


def _training(container: dict):
    """The container's launch.py command, parsed by launch.py train's parser: (args, overrides)."""
    command = container["command"]
    assert command[:3] == ["python", "launch.py", "train"], command  # launch.py is the main process (SIGTERM)
    args = train_cli.parser().parse_args(command[3:])
    return args, args.overrides


@pytest.mark.nocompile
@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_a_jobset_s_pods_processes_accelerators_and_volumes_agree(kind, tmp_path):
    jobset = yaml.safe_load((DEPLOY / f"jobset-{kind}.yaml").read_text())
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/") and jobset["kind"] == "JobSet"
    job, pod, container = _pod(jobset)
    args, overrides = _training(container)
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == args.processes
    assert args.rendezvous and args.member_address == "$(POD_IP)"
    assert container["image"].endswith(f":{kind}")  # the Dockerfile's ACCELERATOR={kind} image
    resource = {"tpu": "google.com/tpu", "gpu": "nvidia.com/gpu"}[kind]
    resources = container["resources"]
    assert resources["limits"][resource] == resources["requests"][resource] == args.devices_per_process
    selector = pod["nodeSelector"]
    if kind == "tpu":  # the slice: its chips are the job's devices, host by host
        assert selector["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
        chips = TPU_CHIPS[selector["cloud.google.com/gke-tpu-topology"]]
        assert chips == args.processes * args.devices_per_process
    else:
        assert selector["cloud.google.com/gke-accelerator"].startswith("nvidia-")
    # every mount names a volume of the pod; the data comes from a claim, read-only, and data.path is in it
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} <= set(volumes)
    config = load_config(ROOT / args.config, overrides, args.workdir)
    data_mount = next(path for path in mounts if config.data.path.startswith(path + "/"))
    data_volume = volumes[mounts[data_mount]["name"]]
    assert data_volume["persistentVolumeClaim"]["claimName"] and mounts[data_mount]["readOnly"] is True
    assert config.data.name == "tokens"  # a real corpus (launch.py tokenize), not synthetic data
    shared = [path for path in mounts if args.workdir.startswith(path + "/") and args.rendezvous.startswith(path + "/")]
    assert shared and "persistentVolumeClaim" in volumes[mounts[shared[0]]["name"]]  # one volume every pod mounts
    assert config.fault.elastic and 1 <= config.fault.min_processes <= args.processes
    assert 0 < config.checkpoint.every_steps <= config.train.steps / 10  # a lost pod costs a tenth at most


@pytest.mark.nocompile
def test_the_dockerfile_copies_what_exists_and_picks_the_jax_extra_by_accelerator():
    text = (DEPLOY / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _ = shlex.split(line)
        for source in sources:
            assert (ROOT / source).exists(), source
    cases = dict(re.findall(r"^\s+(\w+)\) extra=\"([^\"]*)\"", text, re.M))
    assert cases == {"cpu": "", "gpu": "[cuda12]", "tpu": "[tpu]"}
    import jax

    assert re.search(rf"^ARG JAX_VERSION={re.escape(jax.__version__)}$", text, re.M)  # the jax the tests run on
    assert 'ENTRYPOINT ["python", "launch.py"]' in text
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)
