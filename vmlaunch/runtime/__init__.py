"""The lab's life: carrying a Plan out and taking it down (`executor`), the VMs continued in waves as
they boot (`waves`), driving running VMs (`control`), new members forked from a running one (`fork`,
`members`), `down --force` without a journal (`salvage`), the evidence of a lab for a failed test
(`evidence`) and the NUMA report (`numareport`).
"""
