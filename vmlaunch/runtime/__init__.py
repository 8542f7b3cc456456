"""Carrying a Plan out and living with the lab while it runs: the executor (`executor`, up and down), the
journal and lock (`journal`), intents of interrupted operations (`intent`), QEMU processes
(`process`), the VMs continued in waves (`waves`) and their boot timeline (`timeline`), what runs
(`running`), driving running VMs (`control`), snapshots (`snapshot`), `down --force` without a journal
(`salvage`), the lab manager daemon (`manager`, `balancer`), the lab's event log it keeps (`events`)
and the NUMA report (`numareport`).
"""
