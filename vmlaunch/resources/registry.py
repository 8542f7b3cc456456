"""Every kind of host resource, by the name its records carry in the journal. One line per kind."""

from __future__ import annotations

from collections.abc import Callable

from vmlaunch.resources.base import Context, Record
from vmlaunch.resources.bridge import BridgeRecord, release_unjournaled_bridges
from vmlaunch.resources.clone import CloneRecord
from vmlaunch.resources.guest import LabDirRecord, VmFileRecord
from vmlaunch.resources.hugepages import HugepagesRecord
from vmlaunch.resources.image import ImageRecord
from vmlaunch.resources.ksm import KsmRecord, release_unjournaled_ksm
from vmlaunch.resources.manager import ManagerRecord, release_unjournaled_manager
from vmlaunch.resources.netem import NetemRecord
from vmlaunch.resources.pci import PciRecord
from vmlaunch.resources.placement import PlacementRecord
from vmlaunch.resources.remote import (
    RemoteDomainRecord,
    RemoteLinkRecord,
    RemoteNetworkRecord,
    RemotePoolRecord,
)
from vmlaunch.resources.script import ScriptRecord
from vmlaunch.resources.tap import TapRecord
from vmlaunch.resources.vmuser import VmUserClaimRecord, VmUserRecord

RECORDS: dict[str, type[Record]] = {record.kind: record for record in (
    ImageRecord,
    BridgeRecord,
    TapRecord,
    NetemRecord,
    ScriptRecord,
    PciRecord,
    LabDirRecord,
    VmFileRecord,
    HugepagesRecord,
    ManagerRecord,
    KsmRecord,
    PlacementRecord,
    VmUserRecord,
    VmUserClaimRecord,
    CloneRecord,
    RemotePoolRecord,
    RemoteNetworkRecord,
    RemoteLinkRecord,
    RemoteDomainRecord,
)}

# Kinds that keep claims outside the journal (a bridge shared between labs: bridge_registry.py), each a
# function that drops the lab's claims no journaled record backs. One line per kind.
UNJOURNALED_CLAIMS: tuple[Callable[[Context, Callable[[str, str], bool]], list[str]], ...] = (
    release_unjournaled_bridges,
    release_unjournaled_ksm,
    release_unjournaled_manager,
)


def release_unjournaled(ctx: Context, journaled: Callable[[str, str], bool]) -> list[str]:
    """For `down`: drop what an `up` killed between claiming and journaling left; what failed."""
    return [problem for release in UNJOURNALED_CLAIMS for problem in release(ctx, journaled)]
