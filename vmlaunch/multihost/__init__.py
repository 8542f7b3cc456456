"""A lab across several libvirt hosts (`[host.NAME]` in its spec).

- `engine.py`: `up` (connect, place, plan, refuse what is not ours, make it on every host at once,
  all or nothing), the plan's description for `cmdline` and `up --dry-run`.
- `vms.py`: what the lab's commands do with its domains: status, balloon, logs, console, ssh.
- `doctor.py`: each host's checks.

What is made on a host is a journaled record of resources/remote.py, so `down` is the ordinary one.
The domain XML is the one `export --to libvirt` writes (export/libvirt.py), with the volumes' paths.
"""
