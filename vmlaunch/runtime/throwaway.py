"""`vmlaunch run`: a throwaway VM that runs one command and is gone — from a spec's VM
(`spec/throwaway.py` says what it keeps of it) or from a kernel alone (`--kernel`).

One run, in order:
1. Runs of a vmlaunch that is gone (killed, or its machine's power cut) are taken down first
   (`sweep`): each run has a home (`RUN_ROOT/.throwaway/NAME`, its disks and lab dir) whose
   `owner.json` names the process that runs it; a run whose process is gone and that was not kept is
   undone like an interrupted `up` and its home removed.
2. Its disks: each writable disk of the VM a copy of the file as it stands (sparse, shared by reflink
   where the file system can: the lab's own VM may be writing it, and never loses its lock on it), or,
   from a template, a qcow2 overlay of the template's disk. Read-only disks are used as they are.
3. Its lab (`run-<8 hex>`) goes up through the executor like any lab (journaled, confined, undone at
   `down`), cold or from its template (`TemplateStart`: QEMU maps the template's RAM copy-on-write and
   loads its devices' state).
4. The command runs through the command channel, its output written out as it comes back, stdout and
   stderr apart; a guest that panics or a QEMU that exits ends the run at once.
5. The lab goes down (its QEMU quits: nothing of the guest is kept) and its home is removed, unless
   `keep` and the command failed: then it stays, reachable by its name (`vmlaunch exec run-... VM`).

Templates (`saved/template.py`): made on first use when asked (`warm`, or `template = true` on the VM),
by booting the VM with its RAM in a shared file to its ready point (its agent answering), stopping it
and saving its devices' state beside the RAM file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from vmlaunch.compile.plan import Plan, VmPlan
from vmlaunch.errors import AgentError, GuestPanicked, RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.host.facts import Host
from vmlaunch.layout.rundir import RunDir
from vmlaunch.rig import agent
from vmlaunch.saved import template as templates
from vmlaunch.spec import throwaway as spec_throwaway
from vmlaunch.spec.model import Disk, DiskFormat, LabSpec, VmSpec

log = logging.getLogger(__name__)

OWNER = "owner.json"
RECIPE = spec_throwaway.RECIPE
DEFAULT_WAIT = 300.0  # seconds a cold guest gets to answer on its command channel
# cloud-init's modules all run (its runcmd included) before a template of a guest it sets up is saved
CLOUD_INIT_DONE = "command -v cloud-init >/dev/null 2>&1 && cloud-init status --wait >/dev/null 2>&1; true"
TEMPLATE_WAIT = 600.0  # seconds another vmlaunch may take to make a template this one waits for


@attrs.frozen
class Options:
    timeout: float | None = None  # the command's, seconds; None: no limit
    wait: float = DEFAULT_WAIT  # seconds the guest gets to answer
    wait_for: str | None = None  # console text the guest is ready at (a template's ready point too)
    input: bytes | None = None  # the command's stdin
    keep: bool = False  # on failure, the VM stays
    cold: bool = False  # never from a template
    warm: bool = False  # from a template, made now when there is none
    shares: tuple[spec_throwaway.ExtraShare, ...] = ()
    cwd: str | None = None  # the folder in the guest the command runs in
    limit: int = agent.DEFAULT_LIMIT


@attrs.frozen
class Outcome:
    name: str  # the run's lab
    vm: str
    result: agent.Result
    warm: bool  # from a template
    kept: bool
    timings: dict[str, float] = attrs.field(factory=dict, eq=False)

    @property
    def exit_code(self) -> int:
        return self.result.exit_code


# --- homes -----------------------------------------------------------------------------------------


homes = spec_throwaway.homes


def _start_ticks(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat): with the pid, who it is."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    return text.rpartition(")")[2].split()[19] if ")" in text else None


def _owner_alive(home: Path) -> bool:
    try:
        owner = json.loads((home / OWNER).read_text())
    except (OSError, ValueError):
        return False
    if owner.get("kept"):
        return True
    pid = owner.get("pid")
    return isinstance(pid, int) and _start_ticks(pid) == owner.get("ticks")


def _write_owner(home: Path, *, kept: bool = False) -> None:
    from vmlaunch.core.fsutil import write_atomic

    write_atomic(home / OWNER, json.dumps({"pid": os.getpid(), "ticks": _start_ticks(os.getpid()),
                                           "kept": kept}), durable=False)


def _make_home(root: Path, name: str) -> Path:
    """The run's home, made whole with its owner (a sweep never sees a home without one)."""
    from vmlaunch.layout.dirs import secure_dir

    secure_dir(homes(root), top=root, create=True)
    staging = homes(root) / f".{name}"
    staging.mkdir(mode=0o700)
    _write_owner(staging)
    home = homes(root) / name
    os.rename(staging, home)
    return home


# A home being made has no owner for the moment between its mkdir and the owner's write: one without
# an owner is a vmlaunch's that died in that moment only once it is this old (seconds).
STAGING_GRACE = 60.0


def _being_made(home: Path) -> bool:
    """`home` (a staging one) has no owner yet and was made a moment ago: another run is making it."""
    try:
        made = home.lstat().st_mtime
    except OSError:
        return False
    return not (home / OWNER).exists() and time.time() - made < STAGING_GRACE


def sweep(root: Path, timeout: float = 10.0) -> list[str]:
    """Take down every run whose vmlaunch is gone and that was not kept; return their names."""
    folder = homes(root)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    gone = []
    for name in sorted(names):
        home = folder / name
        if name.startswith(".") and spec_throwaway.is_throwaway(name[1:]):
            if not _owner_alive(home) and not _being_made(home):
                templates.remove(home)  # a home being made by a vmlaunch that is gone
            continue
        if not spec_throwaway.is_throwaway(name) or _owner_alive(home):
            continue
        try:
            forget(root, name, timeout)
        except VmlaunchError as exc:
            log.warning("the run %s of a vmlaunch that is gone could not be undone: %s", name, exc)
            continue
        gone.append(name)
        log.info("took down %s: the vmlaunch that ran it is gone", name)
    return gone


def forget(root: Path, name: str, timeout: float = 10.0) -> None:
    """Take the run `name` down (its QEMU quits at once) and remove its home."""
    from vmlaunch.runtime import executor

    run_dir = RunDir.of(root, name)
    if run_dir.path.exists():
        _kill(run_dir)
        with _quiet():  # its QEMU quits, as asked: no guest of it is worth a clean power-off
            executor.down(run_dir, timeout=0, force=True)
    templates.remove(homes(root) / name)


def _kill(run_dir: RunDir) -> None:
    """SIGKILL the throwaway lab's QEMUs (nothing of a throwaway guest is kept: no power-off, no quit),
    and wait until they are gone; `down` then undoes the rest."""
    import signal

    from vmlaunch.core.wait import TimedOut, wait_until
    from vmlaunch.lab import process
    from vmlaunch.layout.rundir import vm_of_file

    pids = []
    names = {vm_of_file(entry) for entry in os.listdir(run_dir.path)}
    for name in sorted(name for name in names if name is not None):
        pid = process.find_pid(run_dir.vm(name))
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            pids.append(pid)
    with contextlib.suppress(TimedOut):
        wait_until(lambda: not any(process.alive(pid) for pid in pids), 5.0, interval=0.005)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The executor's lines of a lab going down at once (a throwaway one) are not said: its warnings are."""
    logger = logging.getLogger("vmlaunch.runtime.executor")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


# --- disks -----------------------------------------------------------------------------------------


def overlay(qemu_img: str, backing: Path, fmt: str, target: Path) -> None:
    """A qcow2 overlay at `target` of `backing` (never written through it)."""
    done = subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", fmt,
                           str(target)], capture_output=True, text=True, check=False,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeFailure(f"an overlay of {backing} could not be made: "
                             f"{done.stderr.strip() or f'qemu-img status {done.returncode}'}")
    os.chmod(target, 0o600)


def own_disks(vm: VmSpec, home: Path) -> dict[int, Disk]:
    """Each writable disk of `vm` as the throwaway VM has it: a copy of the file as it stands, in
    `home`, or (a file not made yet) a new one of its size there."""
    from vmlaunch.runtime.fork import copy_disk

    given = {}
    for index, disk in enumerate(vm.disks):
        if disk.readonly:
            continue
        target = home / f"disk{index}.{disk.format.value}"
        if os.path.exists(disk.file):
            copy_disk(disk.file, target)
            given[index] = attrs.evolve(disk, file=target, size=None, block_device=False,
                                        accept_other_owner=False)
        else:
            given[index] = attrs.evolve(disk, file=target)
    return given


def template_disks(vm: VmSpec, made: templates.Template, home: Path, qemu_img: str) -> dict[int, Disk]:
    """Each writable disk of `vm` as a run from template `made` has it: an overlay of the template's."""
    given = {}
    for index, disk in enumerate(vm.disks):
        if disk.readonly:
            continue
        backing = made.home / f"disk{index}.{disk.format.value}"
        target = home / f"disk{index}.qcow2"
        overlay(qemu_img, backing, disk.format.value, target)
        given[index] = attrs.evolve(disk, file=target, format=DiskFormat.QCOW2, size=None,
                                    block_device=False, accept_other_owner=False)
    return given


def _lab_dir_from(made: templates.Template, run_lab: LabSpec, vm: VmSpec, qemu_img: str) -> None:
    """The run's lab dir as the template's (its keys, seed, instance-id, UEFI variables), with an
    overlay of the template's first disk where the VM boots an image."""
    from vmlaunch.layout.labdir import LabDir

    source = LabDir.of(made.home / "lab.toml", made.lab)
    target = LabDir.of(run_lab.file, run_lab.name)
    if not source.path.is_dir():
        return
    shutil.copytree(source.path, target.path, symlinks=True,
                    ignore=lambda folder, names: [n for n in names if n == "disk.qcow2"])
    if vm.image is not None:
        overlay(qemu_img, source.vm(vm.name).overlay, "qcow2", target.vm(vm.name).overlay)


# --- the run ----------------------------------------------------------------------------------------


@attrs.define
class Started:
    """A throwaway VM that runs (`start`), until `finish`."""

    name: str  # its lab's
    vm: str
    root: Path  # the run root
    lab: LabSpec  # its lab
    plan: Plan
    warm: bool  # woken from its template
    began: float  # time.monotonic() when `start` was called
    timings: dict[str, float] = attrs.field(factory=dict)

    @property
    def run_dir(self) -> RunDir:
        return self.plan.run_dir

    @property
    def home(self) -> Path:
        return homes(self.root) / self.name

    def mark(self, step: str) -> None:
        self.timings[step] = time.monotonic() - self.began


def start(lab: LabSpec, vm_name: str, options: Options, host: Host, *, spec: str | None = None,
          kernel: Mapping[str, Any] | None = None, wants_template: bool | None = None) -> Started:
    """A throwaway VM made from `vm_name` of `lab` that runs (module docstring, steps 1-3), cold or from
    its template; `finish` takes it away. `kernel`: the `--kernel` options a kept run is made again from.
    Nothing is left when it fails (or is interrupted)."""
    began = time.monotonic()
    root = host.run_root
    sweep(root)
    vm = lab.vm(vm_name)
    spec_throwaway.refusals(lab, vm)
    name = spec_throwaway.new_name()
    home = _make_home(root, name)
    timings: dict[str, float] = {}
    done = False
    try:
        qemu_img = host.qemu.img or "qemu-img"
        warm = None
        wanted = (options.warm or bool(wants_template)) and not options.cold
        if wanted and (options.shares or vm.shares):
            log.info("%s boots cold: QEMU cannot save a guest with a 9p share mounted, so a run with "
                     "one has no template", vm.name)
            wanted = False
        if wanted:
            warm = ensure_template(lab, vm, host, spec or str(lab.file), options.wait_for)
            timings["template"] = time.monotonic() - began
        disks = template_disks(vm, warm, home, qemu_img) if warm is not None else own_disks(vm, home)
        run_lab = spec_throwaway.throwaway_lab(lab, vm_name, name, home, disks=disks, shares=options.shares)
        _write_recipe(home, spec, vm_name, disks, options, kernel)
        if warm is not None:
            _lab_dir_from(warm, run_lab, vm, qemu_img)
        plan = _compile(run_lab, host)
        timings["compiled"] = time.monotonic() - began
        try:
            _up(plan, spec or str(lab.file), host, warm, options)
        except RuntimeFailure as exc:
            if warm is None:
                raise
            # a template QEMU cannot load (a QEMU or kernel changed in a way its key does not see) is
            # never used again: this run boots
            log.warning("%s; removed, this run boots cold", exc.message)
            templates.remove(warm.path)
            forget(root, name)
            done = True
            return start(lab, vm_name, attrs.evolve(options, cold=True), host, spec=spec, kernel=kernel,
                         wants_template=False)
        timings["up"] = time.monotonic() - began
        done = True
        return Started(name, vm_name, root, run_lab, plan, warm is not None, began, timings)
    finally:
        if not done:
            from vmlaunch.core import signals

            with signals.held():  # a second Ctrl-C must not cut the cleanup short
                forget(root, name)


def finish(started: Started, *, keep: bool = False) -> None:
    """Take the throwaway VM away (its QEMU quits, its lab is undone, its home removed), or, with `keep`,
    leave it running for `vmlaunch exec NAME VM` (and `vmlaunch down NAME`)."""
    from vmlaunch.core import signals

    with signals.held():  # a second Ctrl-C must not cut the cleanup short
        if keep and started.run_dir.path.exists():
            _write_owner(started.home, kept=True)
            return
        forget(started.root, started.name)
        started.mark("down")


def set_clock(started: Started) -> None:
    """A guest woken from its template reads the template's time: set it to the host's."""
    agent.run(started.run_dir, started.vm, f"date -u -s @{time.time():.3f} >/dev/null 2>&1 || "
              f"date -u -s @{int(time.time())} >/dev/null 2>&1; true", timeout=10.0, wait=10.0)


def run(lab: LabSpec, vm_name: str, cmd: agent.Command, options: Options, host: Host, *,
        stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None, spec: str | None = None,
        kernel: Mapping[str, Any] | None = None, wants_template: bool | None = None) -> Outcome:
    """Run `cmd` in a throwaway VM made from `vm_name` of `lab` (module docstring); the Outcome, whose
    exit code is the command's. `stdout`/`stderr`: where its output goes as it comes back (else it is
    kept in the Result)."""
    started = start(lab, vm_name, options, host, spec=spec, kernel=kernel, wants_template=wants_template)
    kept = False
    try:
        first = "" if started.warm or started.lab.vm(vm_name).cloud_init is None else CLOUD_INIT_DONE
        result = _command(started.run_dir, started.plan.vms[0], cmd, options, started.warm, stdout, stderr,
                          first=first)
        started.mark("ran")
        kept = options.keep and result.exit_code != 0
        return Outcome(started.name, vm_name, result, started.warm, kept, started.timings)
    except BaseException as exc:
        kept = options.keep and isinstance(exc, VmlaunchError)
        raise
    finally:
        finish(started, keep=kept)


def _write_recipe(home: Path, spec: str | None, vm: str, disks: Mapping[int, Disk], options: Options,
                  kernel: Mapping[str, Any] | None) -> None:
    from vmlaunch.core.fsutil import write_atomic

    write_atomic(home / RECIPE, json.dumps({
        "spec": spec, "vm": vm, "kernel": dict(kernel) if kernel else None,
        "disks": {str(index): [str(disk.file), disk.format.value] for index, disk in disks.items()},
        "shares": [[str(share.source), share.target, share.readonly] for share in options.shares],
    }), durable=False)


def _compile(run_lab: LabSpec, host: Host) -> Plan:
    from vmlaunch.compile.compiler import compile_lab
    from vmlaunch.guests.kernels import prepare
    from vmlaunch.guests.sharerules import share_problems

    for _path, message, hint in share_problems(run_lab, ()):  # the spec's were checked as it loaded
        raise UsageError(f"--share: {message}", hint)
    kernels = prepare(run_lab, host, [vm.name for vm in run_lab.vms], build=True)
    plan = compile_lab(run_lab, host, kernels=kernels)
    # no lab manager: a throwaway VM has no balloon policy, KSM or placement to manage, and lives for a
    # command (its QEMU's log and console are the evidence kept of it)
    plan = attrs.evolve(plan, resources=tuple(r for r in plan.resources if r.kind != "manager"))
    if any(vm.shares for vm in run_lab.vms):
        from vmlaunch.guests.shareaccess import require_xattrs

        require_xattrs(run_lab, [vm.name for vm in run_lab.vms])
    return plan


def _up(plan: Plan, spec: str, host: Host, warm: templates.Template | None, options: Options) -> None:
    from vmlaunch.runtime import executor

    start = TemplateStart(warm, plan.run_dir) if warm is not None else None
    executor.up(plan, spec=spec, qemu_img=host.qemu.img, timeout=options.wait,
                wait_for=options.wait_for if warm is None else None,
                from_snapshot=start)  # type: ignore[arg-type]


def watched(vm: VmPlan, call: Callable[[], agent.Result]) -> agent.Result:
    """`call` (a command in the guest, on a thread of its own) while the VM's console and QEMU are
    watched: a panic, or a QEMU that exits, ends the wait at once."""
    from vmlaunch.lab import process

    outcome: dict[str, Any] = {}

    def go() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=go, name=f"run-{vm.name}", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
        if not worker.is_alive():
            break
        panic = process.console_panic(vm.files)
        if panic is not None:
            raise GuestPanicked(f"{vm.name}: the guest panicked: {panic}",
                                "its console (kept with --keep) has the whole trace")
        pid = process.read_pid(vm.files)
        if pid is not None and not process.alive(pid):
            said = process.messages(vm.files).strip()[-300:]
            raise RuntimeFailure(f"{vm.name}: its QEMU exited: {said or 'no message'}")
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, AgentError):
            panic = process.console_panic(vm.files)
            if panic is not None:
                raise GuestPanicked(f"{vm.name}: the guest panicked: {panic}") from None
        raise error
    result: agent.Result = outcome["result"]
    return result


def _command(run_dir: RunDir, vm: VmPlan, cmd: agent.Command, options: Options, warm: bool,
             stdout: IO[bytes] | None, stderr: IO[bytes] | None, *, first: str = "") -> agent.Result:
    """Run the command in the guest while its console and QEMU are watched: a panic, or a QEMU that
    exits, ends the run at once."""
    text = agent.command_line(cmd)
    prefix = b""
    if options.cwd is not None:
        prefix += f"cd -- {shlex.quote(options.cwd)} || exit 125; ".encode()
    if warm:  # a guest woken from its template reads the template's time: the host's, to the ms
        prefix = f"date -u -s @{time.time():.3f} >/dev/null 2>&1 || date -u -s @{int(time.time())} " \
                 f">/dev/null 2>&1; ".encode() + prefix
    if first:  # a cold guest that cloud-init sets up: its runcmd done first, as in a template
        prefix = f"{first}; ".encode() + prefix
    if prefix:
        text = prefix + text
    result = watched(vm, lambda: agent.run(run_dir, vm.name, text, timeout=options.timeout,
                                           input=options.input, wait=options.wait, limit=options.limit,
                                           stdout=stdout))
    if stderr is not None and result.stderr:
        stderr.write(result.stderr)
        stderr.flush()
    return result


# --- templates ---------------------------------------------------------------------------------------


def template_inputs(lab: LabSpec, vm: VmSpec, host: Host, wait_for: str | None = None) -> dict[str, Any]:
    """What decides `vm`'s state at its ready point (saved/template.py): its key is made of these."""
    from vmlaunch.core.version import __version__

    # the VM as a run has it (spec/throwaway.py), under a name that is the same for every run
    as_run = spec_throwaway.throwaway_lab(lab, vm.name, spec_throwaway.RUN_PREFIX + "0" * 8, Path("/"))
    vm = as_run.vm(vm.name)
    definition = attrs.asdict(attrs.evolve(vm, shares=(), cpu_pinning=(), host=None,
                                           disks=tuple(attrs.evolve(d, faults=()) for d in vm.disks)),
                              value_serializer=lambda _i, _a, value: value.value
                              if hasattr(value, "value") and not isinstance(value, (str, int)) else value)
    files: dict[str, Any] = {}
    for label, path in (("kernel", vm.kernel), ("initrd", vm.initrd)):
        if path is not None:
            files[label] = templates.identity(path)
    for index, disk in enumerate(vm.disks):
        files[f"disk{index}"] = templates.identity(disk.file)
    if vm.image is not None:
        image = lab.image(vm.image)
        files["image"] = [image.url, image.sha256, image.sha512,
                          templates.identity(image.file) if image.file else None]
    if vm.cloud_init is not None and vm.cloud_init.user_data is not None:
        files["user_data"] = templates.identity(vm.cloud_init.user_data)
    networks = {nic.network: repr(as_run.network(nic.network)) for nic in vm.nics}
    return {"vm": definition, "files": files, "networks": networks, "mac_prefix": lab.mac_prefix,
            "qemu": [host.qemu.binary, host.qemu.version_text, templates.identity(Path(host.qemu.binary))],
            "kvm": host.kvm.usable, "vmlaunch": __version__, "ready": wait_for}


def template_key(lab: LabSpec, vm: VmSpec, host: Host, wait_for: str | None = None) -> str:
    return templates.key_of(template_inputs(lab, vm, host, wait_for))


def ensure_template(lab: LabSpec, vm: VmSpec, host: Host, spec: str, wait_for: str | None = None
                    ) -> templates.Template | None:
    """The template of `vm`, made now when there is none (said in one line); None when it cannot be
    made (said why: the run then boots cold)."""
    key = template_key(lab, vm, host, wait_for)
    try:
        templates.store()
    except VmlaunchError as exc:
        log.warning("%s: this run boots cold", exc.message)
        return None
    found = templates.find(key)
    if found is not None:
        found.used()
        return found
    with templates.making(key, TEMPLATE_WAIT) as mine:
        if not mine:
            log.warning("template %s of %s is still being made by another vmlaunch: this run boots cold",
                        key, vm.name)
            return None
        found = templates.find(key)  # made by the one this one waited for
        if found is not None:
            found.used()
            return found
        old = [each.key for each in templates.listing() if each.spec == spec and each.vm == vm.name]
        said = (f" (its inputs changed since template {', '.join(old)})" if old else "")
        log.info("making the template of %s%s: it boots once to its ready point", vm.name, said)
        try:
            made = make_template(lab, vm, host, key, spec, wait_for)
        except (VmlaunchError, OSError) as exc:
            log.warning("the template of %s could not be made (%s): this run boots cold", vm.name,
                        exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            return None
        for each in old:  # made of inputs that are gone: never used again
            templates.remove(templates.store() / each)
        templates.bound(keep=key)
        return made


def make_template(lab: LabSpec, vm: VmSpec, host: Host, key: str, spec: str, wait_for: str | None = None
                  ) -> templates.Template:
    """Boot `vm` with its RAM in the template's file to its ready point, save its devices' state, and
    seal the template (saved/template.py). The ready point: `wait_for` on its console when given, then
    its agent answering, then, in a guest cloud-init sets up, cloud-init done (what `up --wait ssh`
    waits for: its runcmd ran)."""
    from vmlaunch.runtime import executor
    from vmlaunch.runtime.fork import shared

    if vm.hugepages is not None:
        raise RuntimeFailure(f"{vm.name}'s memory is hugepages, and a template's RAM is a file")
    folder = templates.temporary(key)
    need = (vm.memory_mib << 20) + sum(os.stat(d.file).st_blocks * 512 for d in vm.disks
                                       if not d.readonly and os.path.exists(d.file))
    free = shutil.disk_usage(folder).free
    if free < need:
        templates.remove(folder)
        raise RuntimeFailure(f"the cache has {free >> 20} MiB free, and a template of {vm.name} takes up to "
                             f"{need >> 20} MiB (its RAM and disks)")
    name = spec_throwaway.new_name(spec_throwaway.TEMPLATE_PREFIX)
    run_dir = RunDir.of(host.run_root, name)
    # a home in the run root too, whose owner is this process: a vmlaunch killed while it makes the
    # template leaves a lab the next command's sweep takes down (the half-made folder goes with
    # `template ls`, or the next template made)
    _make_home(host.run_root, name)
    try:
        home = folder / templates.HOME
        home.mkdir(mode=0o700)
        disks = own_disks(vm, home)
        tpl_lab = spec_throwaway.throwaway_lab(lab, vm.name, name, home, disks=disks)
        plan = _compile(tpl_lab, host)
        ram = folder / templates.RAM
        plan = attrs.evolve(plan, vms=tuple(shared(each, ram, share=True) for each in plan.vms))
        executor.up(plan, spec=spec, qemu_img=host.qemu.img, timeout=DEFAULT_WAIT, wait_for=wait_for)
        began = time.monotonic()
        try:
            ready_cmd = CLOUD_INIT_DONE if vm.cloud_init is not None else "true"
            watched(plan.vms[0], lambda: agent.run(run_dir, vm.name, ready_cmd, timeout=DEFAULT_WAIT,
                                                   wait=DEFAULT_WAIT))
            ready = time.monotonic() - began
            _save_devices(plan.vms[0], folder / templates.STATE)
        finally:
            forget(host.run_root, name)
        return templates.seal(folder, key, {"spec": spec, "vm": vm.name, "lab": name, "ready_s": ready,
                                            "wait_for": wait_for})
    except BaseException:
        with contextlib.suppress(VmlaunchError, OSError):
            forget(host.run_root, name)
        templates.remove(folder)
        raise


def _save_devices(vm: VmPlan, state: Path) -> None:
    """Stop the VM and save its devices' state (its RAM is in the shared file) to `state`."""
    from vmlaunch.layout.rundir import NOFOLLOW
    from vmlaunch.qemu.qmp import QmpError, QuickQmp
    from vmlaunch.runtime.fork import BANDWIDTH, FD_NAME, _wait_saved

    with QuickQmp(vm.files.qmp, 10.0) as qmp:
        qmp.cmd("stop")
        qmp.cmd("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}])
        qmp.cmd("migrate-set-parameters", **{"max-bandwidth": BANDWIDTH})
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
        try:
            qmp.cmd_with_fds("getfd", [fd], fdname=FD_NAME)
        finally:
            os.close(fd)
        try:
            qmp.cmd("migrate", uri=f"fd:{FD_NAME}")
        except QmpError as exc:
            raise RuntimeFailure(f"QEMU cannot save {vm.name}: {exc.message}") from None
        _wait_saved(qmp, vm.name)


@attrs.define
class TemplateStart:
    """What the executor needs to start a throwaway VM from its template (the shape of
    `saved/snapshot.WarmStart`): its RAM the template's file, mapped copy-on-write, and its devices'
    state loaded before it runs."""

    template: templates.Template
    run_dir: RunDir
    name: str = "template"
    descriptors: dict[str, list[int]] = attrs.field(factory=dict)

    def starting(self, vm: VmPlan) -> VmPlan:
        from vmlaunch.runtime.fork import shared

        started = shared(vm, self.template.ram, share=False)
        return attrs.evolve(started, argv=(*started.argv, "-incoming", "defer"))

    def close(self) -> None:
        pass

    def load(self, vms: Sequence[VmPlan], timeout: float) -> None:
        from vmlaunch.lab import process
        from vmlaunch.runtime.fork import _load

        for vm in vms:
            pid = process.read_pid(vm.files)
            why = _load(self.run_dir, vm, pid or 0, run=False, ignore_shared=True, state=self.template.state)
            if why is not None:
                raise RuntimeFailure(f"{vm.name} did not load its template {self.template.key}: {why}",
                                     f"`vmlaunch template rm {self.template.key}` makes it again")

    def step_clocks(self, plan: Plan, vms: Sequence[VmPlan], ports: Mapping[str, int | None]) -> None:
        pass  # the command sets it (`_command`), as its first step


def prune_templates(host: Host, *, every: bool = False) -> list[tuple[str, int, str]]:
    """Remove the templates that would never be used again (damaged, or made of a spec or VM that is
    gone or whose inputs changed), or `every` one; (key, size, why) of each removed."""
    from vmlaunch.spec.load import load_lab

    gone = []
    for each in templates.listing():
        why = "asked" if every else None
        if why is None and each.state != "ok":
            why = each.state
        if why is None:
            try:
                lab = load_lab(each.spec)
                if template_key(lab, lab.vm(each.vm), host, each.wait_for) != each.key:
                    why = "its inputs changed"
            except (VmlaunchError, KeyError):
                why = f"{each.spec} or its VM {each.vm} is gone or does not load"
        if why is not None:
            templates.remove(templates.store() / each.key)
            gone.append((each.key, each.size, why))
    return gone
