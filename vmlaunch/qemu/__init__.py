"""QEMU's two languages, with no knowledge of labs: its option text (`opts`, the one place spec values
become option text) and its monitor protocol (`qmp`).
"""
