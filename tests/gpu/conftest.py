"""Fixtures of the CUDA tests."""

import pytest

from tests.conftest import process_group


@pytest.fixture(scope="module")
def gpu_state():
    """A single-process NCCL group with Megatron parallel state on this machine's first GPU, for one test module."""
    yield from process_group("cuda")
