"""Where things live on disk, each layout spelled in one module: the cache and run roots and the rule
every directory must meet (`dirs`), a lab's run dir (`rundir`), a lab's own dir beside its spec
(`labdir`) and the logs kept of each VM's last run (`lastrun`).
"""
