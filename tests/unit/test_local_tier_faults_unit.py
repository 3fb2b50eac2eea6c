"""The local checkpoint tier's peers and failures: peers on other hosts, steps of another run not
restored, any unreadable step directory set aside, a step that does not read after all agreed
on falls back to the persistent tier, and a failed background write is a warning."""

import os
import shutil

import pytest
from support.configs import ROOT
from support.local_tier_faults import _tier

from engine.checkpoint.exchange import rounds
from engine.checkpoint.local_tier import LocalTier
from engine.checkpoint.peers import HOST_VARIABLE, choose_peers, host_name, one_host
from engine.config import load_config
from engine.errors import UsageError


@pytest.mark.nocompile
def test_peers_are_the_next_processes_on_other_hosts(monkeypatch):
    assert choose_peers(["a", "a", "b", "b"], 1) == [[2], [3], [0], [1]]  # same rank, next host
    assert choose_peers(["a", "b", "a", "b"], 1) == [[1], [0], [3], [2]]
    assert choose_peers(["a", "a", "a", "b"], 1) == [[3], [3], [3], [0]]  # b's one process keeps a's copies
    assert choose_peers(["a", "b", "c"], 1) == [[1], [2], [0]]
    assert choose_peers(["a", "a", "b", "b"], 3) == [[2, 3, 1], [3, 2, 0], [0, 1, 3], [1, 0, 2]]  # own host last
    assert choose_peers(["h"] * 4, 1) == [[1], [2], [3], [0]]  # one host: the next process
    assert choose_peers(["h"], 0) == [[]]
    assert one_host(["h", "h"]) and not one_host(["a", "b"]) and not one_host(["h"])
    monkeypatch.setenv(HOST_VARIABLE, "node{process}")
    assert host_name(3) == "node3"
    # the copies move in rounds in which each process sends once and receives once (one permute each)
    moves = [(0, 3), (1, 3), (2, 3), (3, 0)]
    assert rounds(moves) == [((0, 3), (3, 0)), ((1, 3),), ((2, 3),)]


@pytest.mark.nocompile
def test_a_group_refusing_the_local_tier_names_a_valid_fix(tmp_path):
    from engine.run.group import _refuse_watched

    def load(*overrides):
        tier = [f"checkpoint.local_dir={tmp_path}/shm", "checkpoint.local_every_steps=5"]
        return load_config(ROOT / "configs" / "mnist_mlp.yaml", [*tier, *overrides], str(tmp_path / "run"))

    with pytest.raises(UsageError, match="not supported by a vectorised group") as refused:
        _refuse_watched([load()])
    fix = str(refused.value).rsplit("or set ", 1)[1].split()
    assert fix == ['checkpoint.local_dir=""', "checkpoint.local_every_steps=0"]
    assert not load(*fix).checkpoint.local_dir  # the fix validates


@pytest.mark.nocompile
def test_the_folders_of_a_process_removing_its_own_while_listed_are_left_out(tmp_path, monkeypatch):
    """A fresh elastic start: every process clears its own folder while the others list every
    process index's folders (issue 53: process_2 of 4 raised FileNotFoundError, then hung)."""
    tier = _tier(tmp_path)
    run = tier.root.parent
    for process in (0, 1):
        (run / f"process_{process}" / f"owner_{process}" / "6").mkdir(parents=True)
    real = os.scandir

    class Listed:  # the run folder's entries as listed, then process_1 removed by its own process
        def __init__(self, path):
            with real(path) as entries:
                self.entries = list(entries)
            shutil.rmtree(run / "process_1")

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

        def __iter__(self):
            return iter(self.entries)

        def close(self):
            pass

    monkeypatch.setattr(os, "scandir", lambda path=".": Listed(path) if str(path) == str(run) else real(path))
    tier.discard_after(2)  # (its later steps go; it raised FileNotFoundError from the glob before)
    assert not (run / "process_0" / "owner_0" / "6").exists() and not (run / "process_1").exists()


@pytest.mark.nocompile
def test_a_local_dir_that_cannot_be_created_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("not a folder\n")
    for local_dir in ("/proc/nope", str(tmp_path / "file")):  # (issue 57: a FileNotFoundError traceback)
        with pytest.raises(UsageError, match=rf"checkpoint.local_dir={local_dir}: .* cannot be created"):
            LocalTier(local_dir, tmp_path / "run" / "checkpoints", 3, 1, False, True)
