"""Host changes `up` makes, one module per kind, all in the same shape (see `base.py`).

A planned change (a *resource*: `Image`, `Bridge`, `Tap`, `PciBind`, ...) applies itself and returns a
frozen *record* of what it really did; the record undoes exactly that, later, from another process
too. The executor journals each record and treats every kind alike; `registry.py` lists the kinds.
"""
