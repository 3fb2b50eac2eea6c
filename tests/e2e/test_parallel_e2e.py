"""Parallelism on 8 simulated devices: every layout gives the single-device losses, FSDP
really shards memory, the compiled HLO has the collectives each layout implies, and
misconfigured meshes are refused before compiling."""

from support.cli import run_cli


def test_cli_mesh_error_exits_2_on_8_devices(tmp_path):
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "mesh.data=4",
        "mesh.tensor=4",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert proc.returncode == 2 and "uses 16 devices but 8 are in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dry_run_table_shows_fsdp_layout(tmp_path):
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "--dry-run",
        "mesh.data=1",
        "mesh.fsdp=8",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert proc.returncode == 0, proc.stderr
    line = next(row for row in proc.stdout.splitlines() if row.startswith("hidden_0/kernel"))
    assert "(64, 128)" in line and "('embed', 'mlp')" in line and "('fsdp', None)" in line
    assert "'fsdp': 8" in proc.stdout and "per device: params" in proc.stdout
