"""`vmlaunch export --to kubevirt` checked against the engine's published schemas.

Every exported document is validated with jsonschema against KubeVirt's OpenAPI specification
(tests/data/schemas/kubevirt-v1.9.0-swagger.json: VirtualMachine, and the CDI types of its DataVolume
templates) and the NetworkAttachmentDefinition CRD's openAPIV3Schema (see tests/data/schemas/
SOURCES.md for versions and sources). Validation is strict, as `kubectl apply --validate=strict` is:
a field the schema does not define is an error (the published definitions leave that open), a
quantity must be one, and the fields whose allowed values the schema lists in words (run strategy,
disk cache, io and bus, NIC model, CPU feature policy, hugepage size) are held to those words. On top
of the schema, what KubeVirt's admission checks between fields: each disk has its volume, each
interface its network, each Multus network an exported attachment.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_export import FULL, LAB_KEY, SPECS
from vmlaunch.export.kubevirt import KubevirtOptions, export_kubevirt
from vmlaunch.spec.load import load_lab

SCHEMAS = Path(__file__).parent / "data" / "schemas"
SWAGGER = SCHEMAS / "kubevirt-v1.9.0-swagger.json"
NAD_CRD = SCHEMAS / "network-attachment-definition-v1.7.7-crd.yaml"
# (definition, field): the values its description in the swagger allows
WORDED_ENUMS = {
    ("v1.VirtualMachineSpec", "runStrategy"): ["Always", "Halted", "Manual", "RerunOnFailure", "Once"],
    ("v1.Disk", "cache"): ["none", "writethrough", "writeback"],
    ("v1.Disk", "io"): ["native", "default", "threads"],
    ("v1.DiskTarget", "bus"): ["virtio", "sata", "scsi", "usb"],
    ("v1.CDRomTarget", "bus"): ["virtio", "sata", "scsi"],
    ("v1.Interface", "model"): ["e1000", "e1000e", "igb", "ne2k_pci", "pcnet", "rtl8139", "virtio"],
    ("v1.CPUFeature", "policy"): ["force", "require", "optional", "disable", "forbid"],
    ("v1.Hugepages", "pageSize"): ["1Gi", "2Mi"],
}
# Kubernetes' quantity grammar (the Quantity definition's description)
QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


def strict(definitions: dict[str, Any]) -> dict[str, Any]:
    """The definitions, closed: no field they do not define, the worded enums, quantities, names."""
    closed = copy.deepcopy(definitions)

    def close(schema: Any) -> None:
        if isinstance(schema, dict):
            if "properties" in schema and "additionalProperties" not in schema:
                schema["additionalProperties"] = False
            for value in schema.values():
                close(value)
        elif isinstance(schema, list):
            for value in schema:
                close(value)

    close(closed)
    for (name, field), values in WORDED_ENUMS.items():
        described = closed[name]["properties"][field]
        for value in values:
            assert value in described["description"], (name, field, value)
        described["enum"] = values
    closed["k8s.io.apimachinery.pkg.api.resource.Quantity"]["pattern"] = QUANTITY
    meta = closed["k8s.io.apimachinery.pkg.apis.meta.v1.ObjectMeta"]["properties"]
    meta["name"]["pattern"] = DNS_LABEL
    return closed


@functools.lru_cache(maxsize=1)
def validators() -> dict[str, Any]:
    from jsonschema import Draft4Validator, Draft7Validator

    definitions = strict(json.loads(SWAGGER.read_text())["definitions"])
    vm = Draft4Validator({"$ref": "#/definitions/v1.VirtualMachine", "definitions": definitions})
    crd = yaml.safe_load(NAD_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    nad_schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    nad_schema["properties"].update({
        "apiVersion": {"const": f"{crd['spec']['group']}/v1"},
        "kind": {"const": crd["spec"]["names"]["kind"]},
        "metadata": {"type": "object", "properties": {"name": {"type": "string", "pattern": DNS_LABEL}}},
    })
    nad_schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return {"VirtualMachine": vm, "NetworkAttachmentDefinition": Draft7Validator(nad_schema)}


def errors(document: dict[str, Any]) -> list[str]:
    validator = validators()[document["kind"]]
    return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(document)]


def documents(options: KubevirtOptions, spec: Path = FULL) -> dict[str, dict[str, Any]]:
    result = export_kubevirt(load_lab(spec), options=options)
    return {file.path: yaml.safe_load(file.text) for file in result.files}


VARIANTS = {
    "plain": KubevirtOptions(authorized_key=LAB_KEY),
    "namespaced-ovn-refs": KubevirtOptions(
        namespace="lab-team", ovn_layer2=frozenset({"lan", "mc"}), authorized_key=None,
        refs={"vm.db.kernel": "registry.example/vmlaunch/guest:6.1", "image.local": "pvc:golden-debian",
              "image.debian": "registry:quay.io/containerdisks/debian:12", "vm.db.disk[1]": "dv:shared-data",
              "vm.db.disk[2]": "containerdisk:registry.example/install:1",
              "vm.legacy.pci[0]": "example.com/NIC", "vm.legacy.pci[1]": "example.com/GPU"}),
}


@pytest.mark.parametrize("spec", SPECS, ids=[spec.stem for spec in SPECS])
def test_every_example_validates(spec: Path) -> None:
    for name, document in documents(VARIANTS["plain"], spec).items():
        assert errors(document) == [], name


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_validates(variant: str) -> None:
    found = documents(VARIANTS[variant])
    assert {doc["kind"] for doc in found.values()} == {"VirtualMachine", "NetworkAttachmentDefinition"}
    for name, document in found.items():
        assert errors(document) == [], name


@pytest.mark.parametrize("variant", VARIANTS)
def test_references_between_fields_hold(variant: str) -> None:
    found = documents(VARIANTS[variant])
    attachments = {doc["metadata"]["name"] for doc in found.values()
                   if doc["kind"] == "NetworkAttachmentDefinition"}
    for name, vm in found.items():
        if vm["kind"] != "VirtualMachine":
            continue
        spec = vm["spec"]["template"]["spec"]
        devices = spec["domain"]["devices"]
        assert sorted(d["name"] for d in devices["disks"]) == sorted(v["name"] for v in spec["volumes"]), name
        interfaces = [i["name"] for i in devices.get("interfaces", [])]
        assert interfaces == [n["name"] for n in spec.get("networks", [])], name
        assert sum("pod" in n for n in spec.get("networks", [])) <= 1, name  # one pod network at most
        for network in spec.get("networks", []):
            if "multus" in network:
                assert network["multus"]["networkName"] in attachments, name
        templates = {t["metadata"]["name"] for t in vm["spec"].get("dataVolumeTemplates", [])}
        for volume in spec["volumes"]:
            if "dataVolume" in volume and volume["dataVolume"]["name"].startswith(vm["metadata"]["name"]):
                assert volume["dataVolume"]["name"] in templates, name
        boots = [d for d in devices["disks"] if "bootOrder" in d]
        assert len(boots) <= 1, name
        if "namespace" in vm["metadata"]:
            assert vm["metadata"]["namespace"] == "lab-team"


def test_cni_configs_are_what_the_plugins_read() -> None:
    for variant, options in VARIANTS.items():
        for document in documents(options).values():
            if document["kind"] != "NetworkAttachmentDefinition":
                continue
            config = json.loads(document["spec"]["config"])
            assert config["cniVersion"] == "0.3.1" and config["name"] == document["metadata"]["name"]
            if config["type"] == "bridge":
                assert 1 <= len(config["bridge"]) <= 15 and config["ipam"] == {}
            else:
                assert (config["type"], config["topology"]) == ("ovn-k8s-cni-overlay", "layer2"), variant
                namespace = document["metadata"].get("namespace", "default")
                assert config["netAttachDefName"] == f"{namespace}/{document['metadata']['name']}"


def test_cloud_init_data_is_what_cloud_init_reads() -> None:
    vm = documents(VARIANTS["plain"])["vms/web.yaml"]
    (volume,) = [v for v in vm["spec"]["template"]["spec"]["volumes"] if "cloudInitNoCloud" in v]
    user_data = volume["cloudInitNoCloud"]["userData"]
    assert user_data.startswith("#cloud-config\n")
    config = yaml.safe_load(user_data)
    assert config["users"][0]["name"] == "dev" and config["users"][0]["ssh_authorized_keys"] == [LAB_KEY]
    assert "ssh_keys" not in config and "bootcmd" not in config  # no host key, no share to mount
    network = yaml.safe_load(volume["cloudInitNoCloud"]["networkData"])
    assert network["ethernets"]["nic0"]["addresses"] == ["10.10.0.11/24"]


def test_strict_validation_catches_a_wrong_field() -> None:
    vm = documents(VARIANTS["plain"])["vms/db.yaml"]
    broken = copy.deepcopy(vm)
    broken["spec"]["template"]["spec"]["domain"]["devices"]["disks"][0]["cahce"] = "none"
    broken["spec"]["template"]["spec"]["domain"]["memory"]["guest"] = "512 MiB"
    broken["spec"]["runStrategy"] = "Sometimes"
    found = errors(broken)
    assert any("'cahce' was unexpected" in e for e in found), found
    assert any("512 MiB" in e for e in found) and any("Sometimes" in e for e in found), found


def test_the_schemas_are_the_published_ones() -> None:
    import hashlib

    table = (SCHEMAS / "SOURCES.md").read_text()
    for path in (SWAGGER, NAD_CRD):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(path.name)}`.*\| {digest} \|", table), path.name
