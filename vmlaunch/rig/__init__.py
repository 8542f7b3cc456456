"""The rig's reach into running guests: the command channel (`agent`) and what a test rig does
through it (`guest`: commands that must succeed, waits, copies both ways), faults on the wire (`link`,
`netem`, `partition`) and on the disks (`diskfault`), screens and keyboards (`screen`). What comes back
from a guest is hostile input here.
"""
