"""The shipped post-training example (issue 45, item 4): engine/data/chat_example.py writes the
same bytes for the same seed, its conversations load through data.name=chat with the loss on the
rule's answers, its preference pairs reject a wrong answer, its held-out lists need the rule,
and configs/chat_sft.yaml trains on it (then `sample --chat` renders with its template)."""

from support import chat_example as chat_example_helpers
from support.cli import child_env
from support.configs import QUIET, ROOT
from support.one_process import run_steps

from engine.config import load_config

example = chat_example_helpers.example  # the fixture


def test_the_shipped_sft_config_trains_on_the_example_and_samples_with_its_template(tmp_path, example):
    """configs/chat_sft.yaml at a tiny shape: a run from scratch keeps the template of the model
    directory data.tokenizer names, so `sample --chat` renders with it."""
    data = [
        f"data.path={example / 'chat_train.jsonl'}",
        f"data.eval_path={example / 'chat_eval.jsonl'}",
        f"data.tokenizer={example}",
    ]
    tiny = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "train.steps=2", "train.steps_per_call=1"]
    cfg = load_config(ROOT / "configs" / "chat_sft.yaml")
    assert (cfg.data.name, cfg.data.loss_on, cfg.workdir) == ("chat", "assistant", "runs/chat_sft")
    assert cfg.data.tokenizer == "runs/chat_example" and cfg.data.path.startswith("runs/chat_example/")
    work = tmp_path / "sft"
    args = ["--config", str(ROOT / "configs" / "chat_sft.yaml"), *data, *tiny, "eval.every_steps=2", *QUIET]
    args += ["eval.generate.num_prompts=0"]  # (tests/e2e/test_generation_eval.py runs it)
    sample = ["sample", "--workdir", str(work), "--chat", "--prompt", "sort: 3 1 2", "--max-tokens", "4"]
    trained, sampled = run_steps(  # (through the CLI's main in one process: tests/support/one_process.py)
        tmp_path, [{"argv": [*args, "--workdir", str(work)]}, {"argv": sample}], env=child_env({"HOME": str(tmp_path)})
    )
    assert trained["code"] == 0 and not trained["escaped"], trained["escaped"] or trained["stderr"]
    assert "data: chat train: 60 conversations" in trained["stdout"]
    assert (work / "chat_template.jinja").read_bytes() == (example / "chat_template.jinja").read_bytes()
    assert sampled["code"] == 0 and not sampled["escaped"], sampled["escaped"] or sampled["stderr"]
    dpo = load_config(ROOT / "configs" / "dpo.yaml", [f"finetune.base={work}"])
    assert (dpo.data.name, dpo.train.objective, dpo.dpo.beta, dpo.finetune.lora.rank) == ("preferences", "dpo", 2.0, 8)
    assert (cfg.eval.generate.answer_field, dpo.eval.generate.answer_field) == ("completion", "chosen")
