"""What a lab is while it runs, as every other room reads it: the journal and the lab's lock
(`journal`), its QEMU processes (`process`), what runs now (`running`), the lab's event log (`events`),
the wire's state (`wire`: links, netem, the partition) and where each VM's boot time went
(`timeline`).
"""
