"""Fixtures of the `moe train` tests."""

import pytest

from .run import corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small text corpus for the module's runs (a few standard-library modules)."""
    return corpus(tmp_path_factory.mktemp("corpus"))
