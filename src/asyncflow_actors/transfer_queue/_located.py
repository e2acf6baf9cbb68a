"""Where samples put through shared memory lie, so readers on the host skip the unit (internal).

A writer that stored a put through a shared-memory segment tells the controller, with its
commit, where each row lies in it (:class:`Located`). A lease then carries, for each unit whose
rows of the lease are all located, the parts a ``Fetch`` from that unit would return (segment,
offset, dtype, shape): a reader on the host maps them at once, without a round trip to the unit.

This is safe without the unit's word because the bytes under a segment's name never change: a
segment is written once under a name never used before, and a freed one is refilled only under
a new name (``_shm``: recycled by a rename, and only while no reader holds it). So a location is
either still true (the reader maps exactly the rows that were put) or names a file that is gone
(the unit compacted the rows elsewhere, freed or recycled the segment, or restarted): the reader
then asks the unit, as it would have without a location, and gets the rows or a typed error.

The controller keeps them (``controller._locations``); this module holds the value that travels
and how a writer makes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ._checks import Checked
from ._unit_messages import ShmBody


@attrs.frozen
class Located(Checked):
    """Rows ``indexes`` of one store, in segment ``segment`` of its unit: per column, one
    batch body ``[n, ...]`` or one body per row (as in the ``Store``)."""

    segment: str
    indexes: tuple[int, ...]
    columns: dict[str, ShmBody | list[ShmBody]]


def locate(indexes: Sequence[int], segment: str, part: dict[str, Any]) -> Located | None:
    """The :class:`Located` of a store whose bodies all went to ``segment`` (``None`` when a
    column holds values stored inline, such as text: the unit holds those)."""
    for value in part.values():
        if isinstance(value, list):
            if not all(isinstance(v, ShmBody) for v in value):
                return None
        elif not isinstance(value, ShmBody):
            return None
    return Located(segment, tuple(indexes), dict(part))
