"""Every kind of host resource, by the name its records carry in the journal. One line per kind."""

from __future__ import annotations

from vmlaunch.resources.base import Record
from vmlaunch.resources.bridge import BridgeRecord
from vmlaunch.resources.image import ImageRecord
from vmlaunch.resources.pci import PciRecord
from vmlaunch.resources.tap import TapRecord

RECORDS: dict[str, type[Record]] = {record.kind: record for record in (
    ImageRecord,
    BridgeRecord,
    TapRecord,
    PciRecord,
)}
