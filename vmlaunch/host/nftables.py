"""The lab's own bridge-family nftables table: the partition's host side (`vmlaunch partition`).

One table per lab, `vmlaunch-LAB` (`core.naming.nft_table_name`), family `bridge`, with one chain on
the bridges' forward hook. A cut is a set of sides (the taps of each group of VMs on one bridge
network, the rest of the lab one side too); each side gets one rule dropping what comes in on its taps
and would go out on the taps of every other side, so both directions are cut, ARP included (frames
between two ports of a bridge pass its forward hook, broadcasts once per port they are flooded to).
Frames to and from anything else on the bridge (its uplink, the host, other labs' taps) pass.

The table is replaced as a whole, in one transaction (`add`, `delete`, `add`: the add first makes the
delete succeed when the table is not there), so a rule set is never seen half-made; an empty cut list
removes it. Everything goes through `nft -j -f -` as JSON on standard input: no shell, no quoting.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Sequence
from typing import Any

import attrs

from vmlaunch.errors import HostError, needs_root

log = logging.getLogger(__name__)

FAMILY = "bridge"
CHAIN = "forward"
NFT = "nft"
NFT_TIMEOUT = 30.0  # seconds: nft talks to the kernel only; more means something is wrong
COMMENT_MAX = 120  # nft keeps 128 bytes of a rule's comment
INSTALL_HINT = "install nftables: apt-get install nftables"


@attrs.frozen
class BridgeCut:
    """One bridge network cut into `sides`: each the taps of one group of VMs (the rest of the lab one
    side too), named by `labels` (the VMs of the side), at least two sides."""

    network: str
    sides: tuple[tuple[str, ...], ...]
    labels: tuple[str, ...]


def ruleset(table: str, cuts: Sequence[BridgeCut]) -> dict[str, Any]:
    """The nft JSON document that leaves `table` holding exactly the rules of `cuts` (none: no table)."""
    ref = {"family": FAMILY, "name": table}
    commands: list[dict[str, Any]] = [{"add": {"table": ref}}, {"delete": {"table": ref}}]
    if cuts:
        commands.append({"add": {"table": ref}})
        commands.append({"add": {"chain": {"family": FAMILY, "table": table, "name": CHAIN, "type": "filter",
                                           "hook": "forward", "prio": 0, "policy": "accept"}}})
    for cut in cuts:
        for index, side in enumerate(cut.sides):
            others = sorted({tap for other, taps in enumerate(cut.sides) if other != index for tap in taps})
            comment = f"{cut.network}: {cut.labels[index]} cut off"[:COMMENT_MAX]
            commands.append({"add": {"rule": {
                "family": FAMILY, "table": table, "chain": CHAIN, "comment": comment,
                "expr": [_match("iifname", side), _match("oifname", others),
                         {"counter": {"packets": 0, "bytes": 0}}, {"drop": None}]}}})
    return {"nftables": commands}


def _match(key: str, names: Sequence[str]) -> dict[str, Any]:
    return {"match": {"op": "==", "left": {"meta": {"key": key}}, "right": {"set": sorted(names)}}}


def apply(table: str, cuts: Sequence[BridgeCut]) -> None:
    """Make the table hold the rules of `cuts`, in one transaction (none: remove it)."""
    _run(["-j", "-f", "-"], json.dumps(ruleset(table, cuts)), f"nftables table {FAMILY} {table}")
    if cuts:
        log.debug("nftables table %s %s: %d rules", FAMILY, table, sum(len(cut.sides) for cut in cuts))


def remove(table: str) -> None:
    """Remove the table; nothing happens when it is not there."""
    apply(table, ())


def tables() -> list[str]:
    """The names of the bridge-family tables on this host (this network namespace)."""
    reply = json.loads(_run(["-j", "list", "tables", FAMILY], None, "the nftables tables"))
    return [item["table"]["name"] for item in reply.get("nftables", ()) if "table" in item]


def counters(table: str) -> dict[str, int]:
    """Each rule's comment -> the packets it dropped so far; {} when the table is not there."""
    if table not in tables():
        return {}
    reply = json.loads(_run(["-j", "list", "table", FAMILY, table], None, f"nftables table {table}"))
    found: dict[str, int] = {}
    for item in reply.get("nftables", ()):
        rule = item.get("rule")
        if rule is None:
            continue
        for expr in rule.get("expr", ()):
            if "counter" in expr:
                found[rule.get("comment", "")] = int(expr["counter"]["packets"])
    return found


def _run(args: list[str], stdin: str | None, what: str) -> str:
    try:
        done = subprocess.run([NFT, *args], input=stdin, capture_output=True, text=True, check=False,
                              timeout=NFT_TIMEOUT)
    except FileNotFoundError:
        raise HostError(f"{what}: the nft program is missing", INSTALL_HINT) from None
    except subprocess.TimeoutExpired:
        raise HostError(f"{what}: nft did not answer within {NFT_TIMEOUT:g} s") from None
    if done.returncode != 0:
        error = " ".join(done.stderr.split())[:300] or f"exit status {done.returncode}"
        if "Operation not permitted" in error:
            raise HostError(f"{what}: nft: {error}", needs_root("changing nftables", "CAP_NET_ADMIN"))
        raise HostError(f"{what}: nft failed: {error}",
                        "the kernel needs nftables' bridge family (CONFIG_NF_TABLES_BRIDGE)"
                        if "No such file" in error or "not supported" in error else None)
    return done.stdout
