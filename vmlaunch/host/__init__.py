"""This host: its facts gathered once into a frozen `Host` (`facts`), and every host fact or change the
lab needs: memory and KSM counters (`memory`), NUMA (`numa`), cpuset cgroups (`cgroups`), PCI driver
binding (`pci`), network links over netlink (`links`), each QEMU's confinement (`confine`) and the
files of the run root every lab shares (`hostwide`, `bridge_registry`). sysfs and proc are read
through one root each, which tests point elsewhere.
"""
