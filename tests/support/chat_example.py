"""Helpers of tests/**/test_chat_example*.py that other test files (or its other tiers) share."""

import pytest

from engine.data import chat_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat_example")
    assert chat_example.main([str(directory), "--train", "60", "--eval", "12"]) == 0
    return directory
