"""Experiment trackers (log.trackers): W&B offline run files and an MLflow store, each read back
with the tool's own reader, across a resume and a sweep; a missing tracker is a usage error."""

import pytest

wandb = pytest.importorskip("wandb")


mlflow = pytest.importorskip("mlflow")


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "text, says",
    [
        ('{"wandb": ["2x7kq9ab"]}', 'its wandb run id is ["2x7kq9ab"], not a valid wandb run id'),
        ('{"mlflow": 12}', "its mlflow run id is 12, not a valid mlflow run id"),
        ('{"wandb": "a/b?"}', 'its wandb run id is "a/b?"'),
        ('{"mlflow": ""}', 'its mlflow run id is ""'),
        ('["2x7kq9ab"]', "it holds a list, not an object"),
        ('{"wandb": "2x7k', "not JSON: "),
    ],
)
def test_a_damaged_trackers_json_is_refused_by_name(tmp_path, make_config, text, says):
    from engine.errors import UsageError
    from engine.observe.trackers import check_installed

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "trackers.json").write_text(text)
    cfg = make_config("mnist_mlp.yaml", "log.trackers=[wandb,mlflow]")
    with pytest.raises(UsageError) as refused:
        check_installed(cfg)
    message = str(refused.value)
    assert message.startswith(f"{workdir / 'trackers.json'} is damaged ({says}") and "\n" not in message
    assert "delete it to log into new tracker runs" in message
    assert (workdir / "trackers.json").read_text() == text and [p.name for p in workdir.iterdir()] == ["trackers.json"]
