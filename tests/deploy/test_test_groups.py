"""`make test` hands the suite to pytest-xdist workers with --dist loadgroup, and tests/conftest.py puts
each file's tests (or a folder's, whose files share servers) in one group, so that one worker runs them
in order and their module and session servers start once. Where the group does not reach pytest-xdist,
nothing fails: each test goes to any worker and every worker starts the servers again (with pytest 9.2,
pytest-xdist 3.8 writes the group into a node id field that pytest no longer reads:
pytest-dev/pytest-xdist#1386). This test is that failure."""
import pytest


def test_make_tests_workers_run_this_file_as_its_group(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs on the workers of `make test` (pytest -n N --dist loadgroup) only")
    assert request.node.nodeid.endswith("@tests/deploy/test_test_groups.py"), (
        f"{request.node.nodeid} carries no group: this pytest {pytest.__version__} and pytest-xdist do not group "
        "tests (pytest-dev/pytest-xdist#1386); install requirements-dev.txt's pins")
