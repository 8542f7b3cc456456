"""The pure policies the lab manager and `up` follow: where each balloon goes next (`balloon`) and where
each VM is placed and moved on a NUMA host (`placement`). No I/O: table-tested.
"""
