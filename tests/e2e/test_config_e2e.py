from support.cli import run_cli
from support.fuzz_cli import refused_in_one_line, run_in_one_process

BAD = [  # (overrides, what the one line says)
    (["train.stepz=3"], "did you mean 'train.steps'"),
    (["train.steps=abc"], "must be an int"),
    (
        ["mesh.data=3"],
        "mesh pipeline=1 x data=3 x fsdp=1 x expert=1 x context=1 x tensor=1 uses 3 devices but 1 are in use",
    ),
    (["notakeyvalue"], "is not of the form dotted.key=value"),
    (["model.hidden_sizes=[256,128"], "override 'model.hidden_sizes=[256,128': the value is not valid YAML"),
    (["model.hidden_sizes=128"], "got 128 (int) from the command line, but it must be a list"),
]


def test_cli_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path):
    """The first through launch.py in a process of its own (what a user sees), the others
    through the CLI's main in one process (tests/support/fuzz_cli.py)."""
    argv = lambda i, args: ["--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / f"w{i}"), *args]  # noqa: E731
    (args, expected), *rest = BAD
    proc = run_cli(*argv(0, args))
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    results = run_in_one_process(tmp_path, [{"argv": argv(i, args)} for i, (args, _) in enumerate(rest, 1)])
    assert len(results) == len(rest) == 5
    for result, (_, expected) in zip(results, rest):
        refused_in_one_line(result, expected)
    assert not list(tmp_path.glob("w*"))


def test_cli_missing_config_file_exits_2(tmp_path):
    proc = run_cli("--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "mnist_mlp.yaml" in proc.stderr


def test_cli_help_lists_shipped_configs():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert "mnist_mlp.yaml" in proc.stdout and "key=value" in proc.stdout
