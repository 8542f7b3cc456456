"""`vmlaunch doctor SPEC` of a lab on libvirt hosts: each host checked. Reachable; its libvirt's
version; KVM, or TCG only; its free memory against what the spec pins there; whether its firewall
lets VXLAN's UDP port in (for a network that spans hosts)."""

from __future__ import annotations

from vmlaunch.doctor.findings import Finding, Status
from vmlaunch.errors import VmlaunchError
from vmlaunch.host import remote
from vmlaunch.spec.hosts import VXLAN_PORT, parse_uri
from vmlaunch.spec.model import HostSpec, LabSpec

# the host's firewall, as nftables and iptables list it (either may be missing: `true`)
FIREWALL = "nft list ruleset 2>/dev/null; iptables -S INPUT 2>/dev/null; true\n"


def host_checks(lab: LabSpec, host: HostSpec) -> list[Finding]:
    from vmlaunch.multihost.engine import host_facts

    key = f"libvirt-host.{host.name}"
    try:
        facts = host_facts(host.name, host.uri)
    except VmlaunchError as exc:
        return [Finding(f"{key}.reachable", Status.FAIL, exc.message, "every VM placed there, and every "
                        "network it carries, needs it", exc.hint or "start libvirtd there, or check the URI")]
    found = [Finding(f"{key}.reachable", Status.OK, f"libvirt {facts.version} answers at {host.uri}"),
             Finding(f"{key}.kvm", Status.OK if facts.kvm else Status.WARN,
                     "KVM" if facts.kvm else "no KVM: its domains run under TCG, 10-50 times slower",
                     "libvirt lists a kvm domain type when /dev/kvm is usable there",
                     None if facts.kvm else "load kvm_intel or kvm_amd on that host")]
    pinned = sum(vm.memory_mib for vm in lab.vms if vm.host == host.name)
    found.append(Finding(f"{key}.memory", Status.OK if pinned <= facts.free_mib else Status.FAIL,
                         f"{facts.free_mib} MiB free, {facts.cpus} CPUs; the VMs pinned there need "
                         f"{pinned} MiB", "placement puts the other VMs where there is room",
                         None if pinned <= facts.free_mib else "pin some of them to another host"))
    if not parse_uri(host.uri).shell:
        found.append(Finding(f"{key}.vxlan", Status.NOTE, f"reached over {parse_uri(host.uri).transport}: "
                             "its firewall is not read, and it carries no network that spans hosts"))
        return found
    try:
        rules = remote.shell(host.name, host.uri, FIREWALL)
    except VmlaunchError as exc:
        found.append(Finding(f"{key}.vxlan", Status.WARN, f"its firewall could not be read: {exc.message}"))
        return found
    drops = "policy drop" in rules or "-P INPUT DROP" in rules
    open_ = str(VXLAN_PORT) in rules
    found.append(Finding(f"{key}.vxlan", Status.WARN if drops and not open_ else Status.OK,
                         f"UDP {VXLAN_PORT} (VXLAN) is " + ("let in" if open_ else "not dropped" if not drops
                                                             else "dropped by its input policy"),
                         "a network that spans hosts is carried between them in VXLAN over this port",
                         f"accept UDP {VXLAN_PORT} from the other hosts" if drops and not open_ else None))
    return found


def checks(lab: LabSpec) -> list[tuple[str, list[Finding]]]:
    """A section per host: (title, findings)."""
    from vmlaunch.multihost.engine import parallel

    results, failures = parallel(list(lab.hosts), lambda host: host_checks(lab, host))
    if failures:  # a bug: host_checks says a host's problems as findings
        raise next(iter(failures.values()))
    return [(f"libvirt host {host.name} ({host.uri})", results[host]) for host in lab.hosts]
