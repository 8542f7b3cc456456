"""`vmlaunch doctor [SPEC]`: the seeds' best practices checked on this host and in a lab, each with
what was found, why it matters and the exact fix.

`findings.py` is the shape of a check's answer; `host.py` checks the host (KVM, vhost-net, io_uring,
IOMMU, hugepages, KSM, NUMA, THP, the I/O scheduler behind the image folders, memory and disk space),
`network.py` a lab's bridges and uplinks, `lab.py` the lab itself (memory and vCPU over-commit, disk
space for sparse images, partition alignment, O_DIRECT, cache modes, PCI, hugepages with KSM) with
`disks.py` reading images' partition tables through `qemu-img dd`; `run.py` runs them and prints.
Everything is read through the one sysfs root and the one proc root, so tests show it fake hosts.
`validate` stays host-free; `up` prints the lab checks that warn (`run.lab_warnings`).
"""
