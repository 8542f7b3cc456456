"""The pure policies the lab manager and `up` follow: where each balloon goes next (`balloon`) and where
each VM is placed and moved on a NUMA host (`placement`), how many VMs boot at once (`admission`).
No I/O: table-tested.
"""
