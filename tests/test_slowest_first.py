"""The suite's schedule names real files: tests/conftest.py's SLOWEST_FIRST puts the slowest
files at the head of the run, and a renamed file left in it would quietly go back to the
end (where one slow file alone once held the run for its last 20 minutes)."""

import os

from tests.conftest import REPO, SLOWEST_FIRST


def test_every_file_the_schedule_names_exists_once():
    missing = [p for p in SLOWEST_FIRST if not os.path.isfile(os.path.join(REPO, "tests", p))]
    assert not missing, missing
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)
