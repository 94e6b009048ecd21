"""What tests/conftest.py does to every test process besides scheduling: the collector is off only while collecting.

Why it matters: a run whose collector stayed off would keep every cyclic object the tests make (models, servers'
clients, Pulumi resources) until the worker exits.
"""

from __future__ import annotations

import gc


def test_the_collector_is_on_during_the_tests_and_collection_left_its_objects_frozen() -> None:
    assert gc.isenabled(), "tests/conftest.py did not turn the garbage collector back on after collection"
    assert gc.get_freeze_count() > 10_000, "the objects alive after collection were not frozen"
