"""The lab manager: the daemon that lives beside a running lab (`managerd`, its entry point; `manager`,
its rounds: ballooning, KSM, NUMA balancing, the event log's watch, and stopping when its lab is gone)
and its balloon balancer (`balancer`).
"""
