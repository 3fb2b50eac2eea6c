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
    env = {item["name"] for item in container.get("env", [])}
    index = "$(JOB_COMPLETION_INDEX)"  # (Kubernetes expands it from the env: process 0's value here)
    expanded = [arg.replace(index, "0") if "JOB_COMPLETION_INDEX" in env else arg for arg in command]
    args = train_cli.parser().parse_args(expanded[3:])
    return args, args.overrides


@pytest.mark.nocompile
@pytest.mark.parametrize("name", ["tpu", "gpu", "gpu-elastic"])
def test_a_jobset_s_pods_processes_accelerators_and_volumes_agree(name, tmp_path):
    """jobset-tpu and jobset-gpu: the Kubernetes default, JobSet restarting the whole job when a pod
    fails (it resumes at full size from its newest checkpoint); jobset-gpu-elastic: the opt-in, one
    elastic supervisor per pod meeting the others through etcd, JobSet restarting nothing."""
    kind = name.split("-")[0]
    jobset = yaml.safe_load((DEPLOY / f"jobset-{name}.yaml").read_text())
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/") and jobset["kind"] == "JobSet"
    job, pod, container = _pod(jobset)
    args, overrides = _training(container)
    config = load_config(ROOT / args.config, overrides, args.workdir)
    processes, resource = job["parallelism"], {"tpu": "google.com/tpu", "gpu": "nvidia.com/gpu"}[kind]
    resources = container["resources"]
    devices = resources["limits"][resource]
    assert job["completionMode"] == "Indexed" and job["completions"] == processes
    assert resources["requests"][resource] == devices
    if name.endswith("elastic"):  # the opt-in: supervisors over etcd; JobSet restarts nothing, a container rejoins
        assert args.rendezvous.startswith("etcd://") and args.member_address == "$(POD_IP)"
        assert args.processes == processes and args.devices_per_process == devices
        assert config.fault.elastic and 1 <= config.fault.min_processes < processes
        assert "failurePolicy" not in jobset["spec"] and pod["restartPolicy"] == "OnFailure"
    else:  # the default: no supervisor; a failed pod fails the Job at once and JobSet restarts every pod
        assert not args.rendezvous and not config.fault.elastic
        assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
        assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
        if kind == "gpu":  # process 0's pod is the coordinator, by JobSet's DNS name for it
            rjob = jobset["spec"]["replicatedJobs"][0]["name"]
            assert args.coordinator_address.startswith(f"{jobset['metadata']['name']}-{rjob}-0-0.")
            command = container["command"]
            assert args.num_processes == processes
            assert command[command.index("--process-id") + 1] == "$(JOB_COMPLETION_INDEX)"  # (the pod's index)
    selector = pod["nodeSelector"]
    if kind == "tpu":  # the slice: its chips are the job's devices, host by host
        assert selector["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
        chips = TPU_CHIPS[selector["cloud.google.com/gke-tpu-topology"]]
        assert chips == processes * devices
    else:
        assert selector["cloud.google.com/gke-accelerator"].startswith("nvidia-")
    # every mount names a volume of the pod; the data comes from a claim, read-only, and data.path is in it
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} <= set(volumes)
    data_mount = next(path for path in mounts if config.data.path.startswith(path + "/"))
    data_volume = volumes[mounts[data_mount]["name"]]
    assert data_volume["persistentVolumeClaim"]["claimName"] and mounts[data_mount]["readOnly"] is True
    assert config.data.name == "tokens"  # a real corpus (launch.py tokenize), not synthetic data
    shared = [path for path in mounts if args.workdir.startswith(path + "/")]
    assert shared and "persistentVolumeClaim" in volumes[mounts[shared[0]]["name"]]  # one volume every pod mounts
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
