"""Derived names and name rules (vmlaunch/core/naming.py): interface names that cannot collide by accident
or be taken on purpose, marks, and names the kernel would misread refused."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmlaunch.core.naming import (
    IFNAMSIZ,
    default_bridge_name,
    interface_mark,
    interface_name_problem,
    is_driver_name,
    is_pci_address,
    mark_fields,
    mark_lab,
    tap_name,
)

LAB = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?", fullmatch=True)
VM = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?", fullmatch=True)


def test_names_that_used_to_collide_are_distinct() -> None:
    # vl-{lab}-{network}: lab p network q-r and lab p-q network r were both vl-p-q-r
    assert default_bridge_name("p", "q-r") != default_bridge_name("p-q", "r")
    # the 32-bit tap hash: both were vl-5de46c9f-0 (found by trying ~40,000 lab names)
    assert tap_name("lab33325", "web", 0) != tap_name("lab38274", "web", 0)


def test_derived_names_are_stable_and_fit() -> None:
    assert default_bridge_name("demo", "lan") == "vlbt4n7isj4msxl"
    assert tap_name("demo", "alpha", 0) == "vl-yur4rsmsqd73"
    assert len("vlbt4n7isj4msxl") == IFNAMSIZ - 1


@given(LAB, VM, st.integers(0, 63))
def test_derived_names_are_valid_interface_names(lab: str, vm: str, index: int) -> None:
    for name in (default_bridge_name(lab, vm), tap_name(lab, vm, index)):
        assert interface_name_problem(name) is None
        assert re.fullmatch(r"vl[b-][a-z2-7]{12}", name)
    assert default_bridge_name(lab, vm) != tap_name(lab, vm, index)  # "vlb" vs "vl-"


def test_tap_names_differ_per_nic_vm_and_lab() -> None:
    names = {tap_name(lab, vm, index) for lab in ("a", "b", "a-b") for vm in ("x", "y", "b-x")
             for index in range(3)}
    assert len(names) == 27


@pytest.mark.parametrize(("name", "problem"), [
    ("", "must not be empty"),
    ("x" * 16, "is 16 bytes; interface names have at most 15"),
    ("br0\n", "no '/', ':' or spaces"),  # `$` would let a trailing newline through
    ("br 0", "no '/', ':' or spaces"),
    ("br/0", "no '/', ':' or spaces"),
    ("br:0", "no '/', ':' or spaces"),
    ("..", "not '.' or '..'"),
    ("br%d", "no '%'"),
    ("br\0", "printable ASCII only"),
    ("br\x7f", "printable ASCII only"),
    ("br\x1b[0m", "printable ASCII only"),
    ("brü", "printable ASCII only"),
    ("br\u00a0", "no '/', ':' or spaces"),  # the kernel's isspace() takes it too
])
def test_interface_names_the_kernel_would_refuse_or_misread(name: str, problem: str) -> None:
    found = interface_name_problem(name)
    assert found is not None and problem in found


@pytest.mark.parametrize("name", ["br0", "x" * 15, "vlbr-demo", "eth0.100", "a_b-c+d@e"])
def test_interface_names_accepted(name: str) -> None:
    assert interface_name_problem(name) is None


def test_marks() -> None:
    mark = interface_mark("demo", vm="alpha", bridge="vlbr-demo")
    assert mark == "vmlaunch lab=demo vm=alpha bridge=vlbr-demo"
    assert mark_fields(mark) == {"lab": "demo", "vm": "alpha", "bridge": "vlbr-demo"}
    assert mark_lab(mark) == "demo"
    for alias in (None, "", "uplink to the lab", "vmlaunch", "vmlaunch vm=alpha", "vmlaunchx lab=a",
                  "vmlaunch lab=a lab=b", "vmlaunch lab=a junk"):
        assert mark_lab(alias) is None, alias


def test_other_rules_match_whole_names_only() -> None:
    assert is_pci_address("0000:15:00.0") and not is_pci_address("0000:15:00.0\n")
    assert is_driver_name("vfio-pci") and not is_driver_name("vfio-pci\n")
