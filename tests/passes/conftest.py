import pytest

import lucid_fx


@pytest.fixture
def registry():
    """A private copy of the rule tables, so no test leaks registrations into another."""
    with lucid_fx.registry_scope() as reg:
        yield reg
