"""From a checked spec and the host's facts to a Plan, with no side effect: the files a spec names
checked before anything runs (`preflight`), the pure compiler (`compiler`) and what it produces
(`plan`: each VM's argv and the host resources it needs).
"""
