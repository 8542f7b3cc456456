"""The ground floor: what every other room uses and that knows nothing of labs.

Atomic files (`fsutil`), text from a guest made safe to show (`textsafe`), the one way to wait
(`wait`), held signals (`signals`), sizes and durations (`units`), every derived name and naming rule
(`naming`), key paths back to spec lines (`sourcemap`) and the package's version (`version`).
"""
