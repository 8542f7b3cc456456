"""`vmlaunch image pull|list|rm`: the cache of base images from the command line.

Kept light like the rest of `cli/`: argparse only at import; `guests/images.py` is imported when a
command runs.
"""

from __future__ import annotations

import argparse
import logging

from vmlaunch.cli.common import Commands, command
from vmlaunch.errors import UsageError

log = logging.getLogger("vmlaunch")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    """The `image` command, with its sub-commands."""
    image = command(
        commands, "image", lambda args: _print_help(image),
        help="pull, list and remove base images (the image cache); the image catalog",
        description="Base images ([image.NAME] with a url, or a catalog entry) are downloaded once into "
        "the cache "
        "($XDG_CACHE_HOME/vmlaunch/images), checked against their checksum, and never written: each VM "
        "boots a qcow2 overlay of its own. `up` pulls what is missing; these commands manage the cache.",
    )
    sub = image.add_subparsers(dest="image_command", metavar="SUBCOMMAND", parser_class=type(image))

    pull = command(
        sub, "pull", cmd_pull, help="download the spec's images into the cache",
        description="Download every image of the spec that has a url or a catalog entry (or the images "
        "named) into the cache, unless it is there already, and print where each is. A catalog image is "
        "first pinned: its URL and digest read from its distribution's checksum file (its signature "
        "checked where the distribution signs it and gpgv and the keyring are here) and written to the "
        "lock file beside the spec (SPEC.lock), whose pin every later pull takes. A download is checked "
        "against its "
        "checksum before it is put in place; an interrupted one resumes; two pulls of one image wait for "
        "each other. A named image with a local file is checked against its checksum. A download stops "
        "past VMLAUNCH_IMAGE_MAX_SIZE (64G) received, before the cache's file system keeps less than 5 % "
        "free (at least 1 GiB, at most 4 GiB), and below VMLAUNCH_PULL_SPEED_LIMIT bytes/s (1K; 0: "
        "no minimum) over VMLAUNCH_PULL_SPEED_TIME (60 s).",
        spec=True)
    pull.add_argument("images", metavar="IMAGE", nargs="*", default=[], help="only these images")
    pull.add_argument("--update", action="store_true",
                      help="resolve catalog images anew (the build their distribution has now) and move "
                      "their pins in the lock file (SPEC.lock)")

    command(
        sub, "catalog", cmd_catalog, help="list the image catalog",
        description="The images `[image.NAME] catalog = \"...\"` can name: each distribution's cloud image, "
        "its build (a moving name such as latest, or a release), whether its checksum file is signed, and "
        "what it needs of a VM (UEFI firmware; a CPU newer than QEMU's base models, which vmlaunch's "
        "defaults give). URLs are the distributions' own, or VMLAUNCH_IMAGE_MIRROR's.",
        json="print JSON keyed by catalog name: url, checksum_url (as `image pull` fetches them now, the "
        "mirror applied), format, signed, firmware, cpu_model, version, arch")

    command(
        sub, "list", cmd_list, help="list the cached images",
        description="The cached images: ID (the start of the checksum), the image names they were "
        "pulled as, format, size, when fetched, and the URL; then how many kernels are kept decompressed "
        "for a fast boot under TCG.",
        json='print JSON keyed by "sha512-HEX"')

    rm = command(
        sub, "rm", cmd_rm, help="remove cached images",
        description="Remove cached images, each named by its ID (at least 8 hex digits of its checksum), "
        "an image name or its URL, as `image list` shows them. A VM's overlay needs its image: the next "
        "up pulls it again (the same bytes, by checksum). An image being pulled is left alone.",
    )
    rm.add_argument("ids", metavar="ID", nargs="*", default=[], help="e.g. 3f2a9c1e, or debian")
    rm.add_argument("--all", action="store_true", help="remove every cached image, and partial downloads")
    rm.add_argument("--partial", action="store_true",
                    help="remove the partial downloads of interrupted pulls (not of pulls under way)")
    rm.add_argument("--kernels", action="store_true",
                    help="remove the kernels decompressed for a fast boot under TCG (the next up makes "
                    "what it needs again)")


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from vmlaunch.guests import catalog_images
    from vmlaunch.spec.load import load_lab

    lab = load_lab(args.spec)
    known = [image.name for image in lab.images]
    unknown = [name for name in args.images if name not in known]
    if unknown:
        raise UsageError(f"{args.spec}: no image named {', '.join(map(repr, unknown))}",
                         f"images in this lab: {', '.join(known) or 'none'}")
    chosen = [image for image in lab.images if image.name in args.images
              or (not args.images and (image.url is not None or image.catalog is not None))]
    if not chosen:
        log.info("%s: no image to pull (none has a url or a catalog entry)", args.spec)
    for image in chosen:
        print(f"{image.name}: {catalog_images.ensure(image, update=args.update)}")
    catalogued = [image for image in lab.images if image.catalog is not None and image.lock is not None]
    if catalogued and not args.images:
        assert catalogued[0].lock is not None
        catalog_images.prune(catalogued[0].lock, {image.name for image in catalogued})
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.guests import catalog_images
    from vmlaunch.spec import catalog

    shown = {}
    for name, entry in catalog.entries().items():
        if catalog.host_arch() not in entry.builds:
            continue
        url, checksum_url = entry.locations()
        shown[name] = entry.to_json(catalog_images.fetched(url), catalog_images.fetched(checksum_url))
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    print(f"{'NAME':<20} {'BUILD':<8} {'SIGNED':<7} {'NEEDS':<30} IMAGE")
    for name, entry in catalog.entries().items():
        if name not in shown:
            continue
        needs = entry.needs or "-"
        signed = "yes" if entry.signature else "no"
        print(f"{name:<20} {entry.version:<8} {signed:<7} {needs:<30} {entry.title}")
    log.info("use one: [image.NAME] catalog = \"%s\" (and `version` for a dated build); `vmlaunch init "
             "--image NAME` writes a lab of it", next(iter(shown), "debian-12"))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    import json
    import time

    from vmlaunch.guests import images

    cached = images.list_cached()
    if args.json:
        print(json.dumps({item.id: item.to_json() for item in cached}, indent=2))
        return 0
    if cached:
        print(f"{'ID':<12} {'NAME(S)':<20} {'FORMAT':<6} {'SIZE':>10} {'FETCHED':<16} URL")
    for item in cached:
        fetched = time.strftime("%Y-%m-%d %H:%M", time.localtime(item.fetched)) if item.fetched else "-"
        print(f"{item.short:<12} {', '.join(item.names) or '-':<20} {item.format or '-':<6} "
              f"{images.human_size(item.size):>10} {fetched:<16} {item.url or '-'}")
    if not cached:
        log.info("no image in the cache (%s)", images.cache_dir())
    _kernel_cache_line()
    left = images.partials()
    if left:
        log.info("%d partial download%s in %s: the next pull resumes %s; `vmlaunch image rm --partial` "
                 "removes %s", len(left), "s" if len(left) != 1 else "", left[0].parent,
                 "them" if len(left) != 1 else "it", "them" if len(left) != 1 else "it")
    return 0


def _kernel_cache_line() -> None:
    from vmlaunch.guests import images, kernels

    folder, entries = kernels.cached()
    booted = [entry for entry in entries if entry.elf is not None]
    if booted:
        log.info("%d kernel%s decompressed for a fast boot under TCG, %s, in %s; `vmlaunch image rm "
                 "--kernels` removes them", len(booted), "s" if len(booted) != 1 else "",
                 images.human_size(sum(entry.size for entry in booted)), folder)


def cmd_rm(args: argparse.Namespace) -> int:
    from vmlaunch.guests import images

    if not (args.ids or args.all or args.partial or args.kernels):
        raise UsageError("nothing to remove: give IDs (see `vmlaunch image list`), --all, --partial or "
                         "--kernels")
    if args.ids and args.all:
        raise UsageError("give IDs or --all, not both")
    removed = images.remove(args.ids, every=args.all) if args.ids or args.all else []
    for path in removed:
        print(f"removed {path}")
    if args.all or args.partial:
        parts, busy = images.remove_partials()
        for path in parts:
            print(f"removed {path}")
        for path in busy:
            log.info("kept %s: a pull is under way", path)
    if args.kernels:
        from vmlaunch.guests import kernels

        for path in kernels.remove_all():
            print(f"removed {path}")
    return 0
