"""DPO (train.objective=dpo) with the rest of the engine, through launch.py (issue 45, item 3): mesh
layouts give the one-device metrics, a SIGKILLed run re-runs to the same metrics, a vectorised
learning-rate sweep gives each trial its run alone, `sample` and `export` (merged and PEFT) work
on a DPO LoRA workdir, and `plan` shows one base under LoRA and a reference copy under full
fine-tuning.

Layouts: data, fsdp and tensor are tested here (the tiny model's dims split by 2); mesh.pipeline
and train.sync=diloco are refused with exit 2 (engine/config/objective.py); context and expert
are untested with DPO."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.chat_data import LLAMA, write_jsonl, write_model_dir
from support.cli import child_env, run_cli, start_cli, wait_until
from support.configs import QUIET, RATES
from support.fuzz_cli import refused_in_one_line
from support.llama import write_hf_checkpoint
from support.one_process import run_steps

from engine.runtime.rundir import read_records
from models.llama import LlamaConfig

pytestmark = pytest.mark.slow


VOCAB = 300  # the test tokenizer's (test_chat_data.write_model_dir)


PROMPTS = ["the cat sat", "hello there", "on the mat", "be brief"]


TRAINING = {  # one DPO run: a log record per step, a checkpoint every 4
    "data.name": "preferences",
    "train.objective": "dpo",
    "data.eval_fraction": 0.25,
    "data.seq_len": 16,
    "train.global_batch_size": 4,
    "train.steps_per_call": 1,
    "train.steps": 16,
    "optimizer.learning_rate": 0.01,
    "log.every_steps": 1,
    "checkpoint.every_steps": 4,
    "eval.every_steps": 0,
    "log.progress": False,
    "log.tensorboard": False,
}


LORA = {"finetune.lora.rank": 4, "finetune.lora.alpha": 8, "finetune.lora.targets": "[all]"}


COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"root", "hf", "base", "pairs", "ran"}: a random tiny Llama in Hugging Face's layout with the
    test tokenizer and chat template, imported (the LoRA runs' frozen base), preference pairs, and
    the results of the tests' one-device command lines (one_device: the import first), all
    through the CLI's main in one process (tests/support/one_process.py)."""
    root = tmp_path_factory.mktemp("dpo_runs")
    write_hf_checkpoint(root / "hf", LlamaConfig(**LLAMA), vocab=VOCAB)
    write_model_dir(root / "hf")
    records = [{"prompt": p, "chosen": "hello", "rejected": "the mat"} for p in PROMPTS * 4]
    records += [{"prompt": p, "chosen": "on the mat", "rejected": "be brief"} for p in PROMPTS]
    pairs = write_jsonl(root / "pairs.jsonl", records)
    files = {"root": root, "hf": root / "hf", "base": root / "base", "pairs": pairs}
    steps = [{"name": name, "argv": argv} for name, argv in one_device(files).items()]
    (root / "one").mkdir()
    results = run_steps(root / "one", steps, env=child_env({"HOME": str(root)}))
    return {**files, "ran": {result["name"]: result for result in results}}


def one_device(files) -> dict[str, list[str]]:
    """The one-device command lines: the import, the LoRA and full fine-tuning runs the others
    compare with, the sweep test's run alone and a sample of the LoRA run."""
    root = files["root"]
    return {
        "import": ["import-hf", str(files["hf"]), "--workdir", str(files["base"]), *QUIET],
        "lora": run_args(files, True, root / "lora"),
        "full": run_args(files, False, root / "full"),
        "alone": run_args(files, False, root / "alone", **{"optimizer.learning_rate": 0.03, "dpo.beta": 0.5}),
        "sample": ["sample", "--workdir", str(root / "lora"), "--chat", "--prompt", "hello there", "--max-tokens", "1"],
    }


def ran(files, name) -> dict:
    result = files["ran"][name]
    assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stderr"][-3000:]
    return result


def run_args(files, lora: bool, workdir, **overrides) -> list[str]:
    keys = {**TRAINING, "data.path": files["pairs"], "data.tokenizer": files["base"]}
    if lora:
        keys.update(LORA, **{"finetune.base": files["base"]})
    keys.update(overrides)
    settings = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
    return ["--config", str(files["base"] / "config.yaml"), "--workdir", str(workdir), *settings]


def train(files, lora: bool, workdir, env=None, **overrides):
    proc = run_cli(*run_args(files, lora, workdir, **overrides), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def records(workdir, split="train") -> list[dict]:
    """The run's records of `split`, without the fields that measure speed."""
    rows = read_records(workdir / "metrics.jsonl")
    return [
        {k: v for k, v in r.items() if k not in RATES and not k.endswith("_per_sec")}
        for r in rows
        if r["split"] == split
    ]


@pytest.fixture(scope="module")
def lora_run(files):
    """A one-device DPO run with LoRA adapters on the imported base."""
    ran(files, "import")
    ran(files, "lora")
    return files["root"] / "lora"


@pytest.fixture(scope="module")
def full_run(files):
    """A one-device DPO run of full fine-tuning, from the seeded initialisation."""
    ran(files, "import")
    ran(files, "full")
    return files["root"] / "full"


@pytest.fixture(scope="module")
def eight(files, tmp_path_factory):
    """On 8 devices, through the CLI's main in one process: both runs at data=2, fsdp=2, tensor=2
    (4 steps), then mesh.pipeline and train.sync=diloco, each refused → {name: result}."""
    ran(files, "import")
    tmp = tmp_path_factory.mktemp("eight")
    layout = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.steps": 4}
    steps = [
        {"name": name, "workdir": str(tmp / name), "argv": run_args(files, name == "lora", tmp / name, **layout)}
        for name in ("lora", "full")
    ]
    for i, (key, value) in enumerate(REFUSED):
        keys = {key: value, "mesh.data": 2, **({"diloco.replica_axis": "data"} if value == "diloco" else {})}
        steps.append({"name": key, "argv": run_args(files, False, tmp / f"w{i}", **keys)})
    results = run_steps(tmp, steps, env=child_env({"HOME": str(tmp), **EIGHT}))
    return {result["name"]: result for result in results}


REFUSED = [("mesh.pipeline", 2), ("train.sync", "diloco")]


def assert_same_metrics(got: list[dict], expected: list[dict], rtol: float):
    """Equal to rtol; the rewards, beta * (log p - reference log p) of responses of log p ~ -12 (beta
    <= 1 here), also to a few float32 roundings of that scale: the difference of two such sums cancels
    to ~1e-3 and keeps only their absolute error (a vectorised program sums in another order than a
    run alone: 1.2e-6 apart seen)."""
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    scale = max(abs(r[name]) for r in expected for name in ("logps/chosen", "logps/rejected"))
    for name in (*COMPARED, "logps/rejected"):
        atol = 4 * float(np.finfo(np.float32).eps) * scale if name.startswith("rewards/") else 0.0
        np.testing.assert_allclose(
            [r[name] for r in got], [r[name] for r in expected], rtol=rtol, atol=atol, err_msg=name
        )


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_data_fsdp_and_tensor_give_the_one_device_metrics(lora_run, full_run, eight, lora):
    one = records(lora_run if lora else full_run)
    assert np.ptp([r["loss"] for r in one]) > 1e-3 and max(abs(r["rewards/margins"]) for r in one) > 1e-3  # it trains
    result = eight["lora" if lora else "full"]
    assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stderr"][-3000:]
    assert_same_metrics(records(Path(result["workdir"])), one[:4], rtol=1e-5)


def test_pipeline_and_diloco_are_refused_naming_the_key(eight):
    """Each in one line, through the CLI's main in one process of 8 devices."""
    for key, value in REFUSED:
        refused_in_one_line(eight[key], f"train.objective=dpo does not run with {key}={value}")


def test_sigkill_then_rerun_gives_the_same_metrics(files, lora_run, tmp_path):
    workdir = tmp_path / "killed"
    proc = start_cli(*run_args(files, True, workdir))
    wait_until(lambda: (workdir / "checkpoints" / "8").is_dir(), proc, seconds=240, poll=0.01)
    proc.kill()
    proc.wait()
    cut = records(workdir)
    assert cut and cut[-1]["step"] < TRAINING["train.steps"]  # it really was cut short
    train(files, True, workdir)  # the same command again: it resumes from the killed run's checkpoint
    done = records(workdir)
    assert done == records(lora_run) and records(workdir, "eval") == records(lora_run, "eval")


def test_a_vectorised_learning_rate_and_beta_sweep_gives_each_trial_its_run_alone(files, full_run, tmp_path):
    """Full fine-tuning (a LoRA run on finetune.base is not vectorised: the sweep refuses it)."""
    overrides = {**TRAINING, "data.path": str(files["pairs"]), "data.tokenizer": str(files["base"])}
    spec = {
        "base": str(files["base"] / "config.yaml"),
        "directory": str(tmp_path / "out"),
        "overrides": overrides,
        "zip": {"optimizer.learning_rate": [0.01, 0.03], "dpo.beta": [0.1, 0.5]},  # (full_run's: 0.01, 0.1)
        "vectorize": "auto",
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    proc = run_cli("sweep", str(tmp_path / "sweep.yaml"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 runs as 1 program(s) of 2" in proc.stdout, proc.stdout  # one vectorised program
    ran(files, "alone")
    alone = files["root"] / "alone"
    trials = {r["name"]: Path(r["workdir"]) for r in map(json.loads, (tmp_path / "out" / "sweep.jsonl").open())}
    assert sorted(trials) == ["beta=0.1,learning_rate=0.01", "beta=0.5,learning_rate=0.03"]
    for name, expected in (("beta=0.1,learning_rate=0.01", full_run), ("beta=0.5,learning_rate=0.03", alone)):
        assert_same_metrics(records(trials[name]), records(expected), rtol=1e-5)
        assert_same_metrics(records(trials[name], "eval"), records(expected, "eval"), rtol=1e-5)
    assert records(alone)[-1]["loss"] != pytest.approx(records(full_run)[-1]["loss"], rel=1e-3)  # they differ


def test_sample_and_export_of_a_dpo_lora_workdir(files, lora_run, tmp_path):
    from safetensors.numpy import load_file

    from engine.hub.hf import export_hf

    sampled = ran(files, "sample")
    assert sampled["stdout"].strip(), sampled["stderr"][-2000:]
    for out, merge in ((tmp_path / "merged", True), (tmp_path / "adapter", False)):  # (`export --format hf`'s)
        export_hf(str(lora_run), str(out), merge=merge)
    base, merged = (
        load_file(str(files["hf"] / "model.safetensors")),
        load_file(str(tmp_path / "merged" / "model.safetensors")),
    )
    adapters = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    assert sorted(merged) == sorted(base)
    adapted = 0
    for name, weight in base.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        expected = weight
        if f"{prefix}.lora_A.weight" in adapters:  # [out, r] @ [r, in], as PEFT merges
            delta = adapters[f"{prefix}.lora_B.weight"] @ adapters[f"{prefix}.lora_A.weight"]
            assert np.abs(delta).max() > 1e-6, name  # DPO moved this adapter
            expected, adapted = weight + scale * delta, adapted + 1
        np.testing.assert_allclose(merged[name], expected, rtol=1e-5, atol=1e-7, err_msg=name)
    assert adapted == 7 * LLAMA["num_layers"]  # q, k, v, o, gate, up, down of every layer


def test_plan_holds_one_base_under_lora_and_a_reference_copy_under_full_fine_tuning(files, make_config):
    pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")
    from engine.plan.compiled import plan
    from engine.plan.tpu import parse_target

    def state(objective: str, lora: bool):
        keys = {**TRAINING, **(LORA if lora else {})}
        if objective == "lm":
            keys.update({"train.objective": "lm", "data.name": "synthetic_text", "data.vocab_size": VOCAB})
        else:
            keys.update({"data.path": files["pairs"], "data.tokenizer": files["base"]})
        settings = [f"{k}={v}" for k, v in keys.items()] + ["mesh.fsdp=4", "data.steps_per_transfer=1"]
        planned = plan(make_config(str(files["base"] / "config.yaml"), *settings), parse_target("v5e-4"))
        assert planned.fits
        return planned.programs[0]

    dpo_lora, sft_lora, dpo_full = state("dpo", True), state("lm", True), state("dpo", False)
    assert (dpo_lora.params, dpo_lora.optimizer) == (sft_lora.params, sft_lora.optimizer)
    # one base under LoRA, no reference copy (DPO's state adds dpo.beta, a float32 step input)
    assert 0 <= dpo_lora.other_state - sft_lora.other_state <= 16
    assert dpo_full.params <= dpo_lora.other_state < 2 * dpo_full.params  # the frozen base, once
    assert dpo_full.params <= dpo_full.other_state <= dpo_full.params + 1024  # the reference: a copy of the params
