import pytest
import yaml
from support.configs import ROOT

from engine.config import load_config, to_yaml
from engine.errors import UsageError


@pytest.mark.nocompile
def test_a_data_key_of_another_source_is_refused_on_the_command_line_and_noted_in_a_file(tmp_path, capsys):
    """data has a section per source (data.name chooses it, as model.name chooses the model's):
    a key typed for another source is refused by name; one a file carries (a workdir's
    config.yaml once listed every source's keys) is ignored with a note, so old runs still load."""
    with pytest.raises(UsageError, match=r"data.seq_len is a key of data.name=.*not of data.name=digits"):
        load_config(ROOT / "configs" / "mnist_mlp.yaml", ["data.seq_len=64"])
    # a launcher's defaults for one source, then the user's own data.name: the earlier keys go
    cfg = load_config(
        ROOT / "configs" / "mnist_mlp.yaml", ["data.name=synthetic_text", "data.seq_len=8", "data.name=digits"]
    )
    assert cfg.data.name == "digits" and not hasattr(cfg.data, "seq_len")
    old = yaml.safe_load(to_yaml(load_config(ROOT / "configs" / "llama_tiny.yaml")))
    old["data"]["eval_fraction"] = 0.1  # another source's key, at a value of its own
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**old, "data": {**old["data"], "name": "digits"}}))
    cfg = load_config(tmp_path / "config.yaml")
    assert cfg.data.eval_fraction == 0.1  # digits reads it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**old, "data": {**old["data"], "num_classes": 7}}))
    cfg = load_config(tmp_path / "config.yaml")
    assert cfg.data.name == old["data"]["name"] and "data.num_classes is not read by" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({**old, "data": {"name": "digits", "sources": [{"path": "x"}]}})
    )
    with pytest.raises(UsageError, match="data.sources is a mixture"):
        load_config(tmp_path / "config.yaml")


@pytest.mark.nocompile
def test_the_loaded_config_is_frozen(make_config):
    import dataclasses

    cfg = make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.shuffle = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.hidden_sizes = [3]  # type: ignore[misc]


@pytest.mark.nocompile
def test_lora_in_a_workdir_of_full_weights_is_refused_before_the_data_is_read(tmp_path):
    """An import's (or a full fine-tuning run's) workdir: its checkpoints hold full weights, so LoRA
    there is refused at load, not after the data's 30 s of loading (issue 53.12)."""
    work = tmp_path / "imported"
    (work / "checkpoints" / "0").mkdir(parents=True)
    (work / "config.yaml").write_text("finetune:\n  lora:\n    rank: 0\n")
    lora = ["data.name=tokens", "data.path=/nonexistent", "finetune.lora.rank=8"]
    with pytest.raises(UsageError, match=f"fine-tune in a new workdir with finetune.base={work}"):
        load_config(ROOT / "configs" / "llama_tiny.yaml", lora, str(work))
    load_config(ROOT / "configs" / "llama_tiny.yaml", lora, str(tmp_path / "new"))  # a new workdir: fine
    (work / "config.yaml").write_text("finetune:\n  lora:\n    rank: 8\n")  # a LoRA run resumed: fine
    load_config(ROOT / "configs" / "llama_tiny.yaml", lora, str(work))
