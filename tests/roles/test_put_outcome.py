"""What a failed group put means to the Rollout: a put whose samples were evicted or lost before
it committed is dropped (the queue reports them and the Driver re-injects the prompt), whether
the controller refused the commit or the client reports it as ``StorageUnavailable``."""

from __future__ import annotations

from asyncflow_actors.roles._group_writing import _put_outcome
from asyncflow_actors.transfer_queue import StorageUnavailable, UnknownSample


def dropped_before_commit() -> StorageUnavailable:
    try:
        try:
            raise UnknownSample("rollout", [152, 153])
        except UnknownSample as exc:
            raise StorageUnavailable("dropped before it committed") from exc
    except StorageUnavailable as exc:
        return exc


def test_a_put_dropped_before_its_commit_is_gone_not_a_crash() -> None:
    assert _put_outcome(UnknownSample("rollout", [1])) == "gone"
    assert _put_outcome(dropped_before_commit()) == "gone"


def test_a_unit_that_stays_unavailable_is_a_real_error() -> None:
    assert _put_outcome(StorageUnavailable("unit 'unit-0' did not answer")) is None
    assert _put_outcome(ValueError("bad shape")) is None
