"""The lab manager's memory-balloon policy: where each guest's balloon target goes next.

A pure function. The manager samples every VM once per interval (QMP query-balloon and the
virtio-balloon stats), calls `decide`, sets the targets it returns and logs their reasons. Nothing
here reads a clock, a file or a socket, so a round is a table test.

Words used below, all for one guest in one round:

- *size*: its committed target (the target the manager set last, else the balloon's actual size),
  brought into [minimum, maximum]. The policy reasons about the size, not about the actual size: a
  balloon still on its way to a target is not asked to move again.
- *used*: actual - available, the memory the guest would still need at any size. Not total - available:
  with deflate-on-OOM the guest counts the balloon itself as used memory, and then only
  actual - available leaves it out. *spare* = size - used is the memory the guest has available once
  the balloon gets to its size (equal to `available` when the balloon is there).
- *short*: spare under `short` of its size; or thrashing (major faults, or swap-ins counted in 4 KiB
  pages, above `fault_rate` per second) while spare is not over `plenty`. A guest with plenty of
  memory that faults is reading files into a cold page cache (a boot), not short of memory.
- *plenty*: spare over `plenty` of its size, and available over `plenty` of its actual size (a
  step of growth that the balloon has not reached yet is not given back before the guest used it).
- *floor*: the least it may give back to: its minimum, and used + margin (`margin` of used, at least
  `margin_floor`); for a guest whose balloon once stopped short of a lower target (`Guest.floor`:
  its driver found no page to give, which the manager sees as a balloon that stopped moving or as
  "Out of puff" or the OOM killer on its console), also that size + margin: its minimum rises to it,
  so no round asks it for what it cannot give, and a target already under it is raised at once.
- the *cap*: the budget, further capped by what the host can give the lab, host.available plus the
  guests' actual sizes less `host_reserve` of the host's total memory.

A round, in this order:

1. Bounds first: a size under the minimum is raised to it, one over the maximum lowered to it.
2. If even the guests' minimums exceed the cap (the host itself runs short, or a budget under the
   minimums, which the spec check refuses), every guest is held at its minimum, at once: the host
   running out of memory would kill whole VMs. Nothing else happens in that round.
3. Every guest with plenty gives memory back, down to its floor, at most `shrink_step` of its maximum
   per round, whether or not another guest needs it: memory flows to need, not to idleness, and what
   idle guests give back is the headroom the next short guest grows into.
4. If the lab is still over its cap (the budget was lowered; at start, when the maximums add up to
   more than the budget), guests with stats that are not short give more, those with the most spare
   first, down to their floor, within the same per-round step; then guests without stats yet, toward
   their minimum. What one round cannot give the next one continues. Here the dead band gives way to
   the budget: a last piece smaller than it is still taken.
5. Short guests grow, the most short (smallest spare fraction) first: a guest short of memory toward
   the size at which its spare would sit halfway between `short` and `plenty` (so it lands in
   neither), a thrashing guest by a step over its actual size; at least by `dead_band`, at most by
   `grow_step` of its maximum, never above its maximum. The memory comes from what is left under the
   cap (which step 3 has added to), then from guests with stats that are not short, those with the
   most free memory first, down to their floor within the same per-round step: a short guest's need
   comes before another's comfort, and at its floor a guest is still not short. Guests without stats
   are not asked: they may need all they have. Growth waits while the lab is over its cap.

Damping: no change smaller than `dead_band` (bounds, step 2 and step 4 aside). A guest that is
neither short nor has plenty keeps its size unless a short guest needs memory; idle guests are not
grown back. A guest that grows is never shrunk in the same round. Giving back stops at used +
margin, where a guest is not short (`Params` refuses a margin for which it would be), and growth
stops under `plenty`: with a steady load a guest moves for a few rounds, turns back at most once
(a growth of one dead band can leave a small guest with plenty), then stays.

Output: a Decision for each guest whose target changes, in the order of `guests`; targets are whole
MiB within [minimum, maximum]. `free` orders the donors of step 5; `total` is not needed (see *used*).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from vmlaunch.core.units import format_size

MIB = 1 << 20
PAGE = 4096  # swap-ins are compared with fault_rate in pages: each one is a major fault in the guest


@attrs.frozen
class Guest:
    """One VM as sampled at the start of a round; every size in bytes."""

    name: str
    maximum: int  # the VM's `memory`: the balloon never goes above it
    minimum: int  # `balloon.min`: never below it
    actual: int  # the balloon's actual size (query-balloon)
    target: int | None  # the target the manager set last; None: none yet
    available: int | None  # stat-available-memory; None before the guest reports stats
    free: int | None  # stat-free-memory
    total: int | None  # stat-total-memory: the guest's total as it sees it
    major_faults: float  # per second since the last sample; 0.0 when unknown
    swap_in: float  # bytes per second since the last sample; 0.0 when unknown
    # Where its balloon stopped giving, short of a lower target (its driver found no more pages to
    # give: the guest's own floor, as observed); None when never seen. Never asked below it again.
    floor: int | None = None


@attrs.frozen
class Host:
    total: int  # bytes, MemTotal
    available: int  # bytes, MemAvailable


@attrs.frozen
class Params:
    """The policy's knobs. Fractions are of a guest's size unless said otherwise."""

    # Under 15 % spare the guest's page cache is nearly gone and reclaim is about to start;
    # over 40 % it holds enough to give a step back and still be well clear of short. The gap
    # between the two is the hysteresis that keeps a guest from flapping between them.
    short: float = 0.15
    plenty: float = 0.40
    # Giving back keeps a fifth of used free (1/6 of the size: just clear of `short`), and at least
    # 32 MiB, which a small guest needs for page cache and a burst of allocations.
    margin: float = 0.20
    margin_floor: int = 32 * MIB
    # Of the guest's maximum, per round. Growing is urgent (a guest short of memory swaps or
    # OOM-kills), giving back is not, and a slow shrink lets a guest whose load comes back keep
    # most of its memory.
    grow_step: float = 0.25
    shrink_step: float = 0.10
    # Smaller moves are not worth a balloon round trip and would follow the noise of the stats.
    dead_band: int = 16 * MIB
    # Of the host's MemTotal, kept for the host itself (QEMU's own memory, page cache, the manager).
    host_reserve: float = 0.10
    # Major faults per second: a few a second is normal, 50 sustained over an interval is
    # a working set that no longer fits.
    fault_rate: float = 50.0

    def __attrs_post_init__(self) -> None:
        if not 0 < self.short < self.plenty < 1:
            raise ValueError(f"need 0 < short < plenty < 1, got short {self.short}, plenty {self.plenty}")
        # A guest given back to used + margin must not count as short, or it grows back next round
        # and gives again, every round.
        if self.margin / (1 + self.margin) <= self.short:
            least = self.short / (1 - self.short)
            raise ValueError(f"margin {self.margin} leaves a guest that gave memory back short "
                             f"(under {self.short}); it needs a margin over {least:.3f}")
        if not (0 < self.grow_step <= 1 and 0 < self.shrink_step <= 1):
            raise ValueError("grow_step and shrink_step are fractions of the maximum in (0, 1]")
        if not 0 <= self.host_reserve < 1:
            raise ValueError(f"host_reserve {self.host_reserve} is not a fraction in [0, 1)")
        if self.margin_floor < 0 or self.dead_band < 0 or self.fault_rate < 0:
            raise ValueError("margin_floor, dead_band and fault_rate cannot be negative")

    @property
    def aim(self) -> float:
        """The spare fraction a growing guest is brought to: halfway, so it is neither short nor plenty."""
        return (self.short + self.plenty) / 2


@attrs.frozen
class Decision:
    name: str
    target: int  # bytes, a whole number of MiB
    reason: str  # for the manager's log: "short: 32M available of 256M (under 15 %): grows by 53M"


@attrs.define
class _Slot:
    """One guest while a round is planned: its target moves, the sample stays as it was."""

    guest: Guest
    order: int  # its place in `guests`: the last tie-breaker, for a deterministic round
    lo: int  # minimum and maximum as whole MiB, inside the guest's own bounds
    hi: int
    size: int  # where the round starts
    target: int
    notes: list[str] = attrs.Factory(list)

    @property
    def stats(self) -> bool:
        return self.guest.available is not None

    @property
    def used(self) -> int:
        guest = self.guest
        return max(0, guest.actual - guest.available) if guest.available is not None else 0

    @property
    def spare(self) -> int:
        return self.size - self.used

    @property
    def spare_fraction(self) -> float:
        return self.spare / self.size if self.size > 0 else 0.0

    def short_of_memory(self, params: Params) -> bool:
        return self.stats and self.spare < params.short * self.size

    def plenty(self, params: Params) -> bool:
        # Where the balloon is too: growth set last round and not reached yet is not given back
        # before the guest could use it.
        actual = self.guest.actual
        return self.stats and self.spare > params.plenty * self.size and \
            actual - self.used > params.plenty * actual

    def thrashing(self, params: Params) -> bool:
        guest = self.guest
        return self.stats and not self.plenty(params) and (
            guest.major_faults > params.fault_rate or guest.swap_in / PAGE > params.fault_rate)

    def short(self, params: Params) -> bool:
        return self.short_of_memory(params) or self.thrashing(params)

    def floor(self, params: Params) -> int:
        used = self.used
        return max(self.lo, _ceil_mib(used + max(int(params.margin * used), params.margin_floor)))

    def give_bound(self, params: Params) -> int:
        """The lowest target this round may set: one step under where it started, not under the floor."""
        step = int(params.shrink_step * self.guest.maximum)
        floor = self.floor(params) if self.stats else self.lo
        return min(self.target, max(floor, _ceil_mib(self.size - step)))

    def move(self, target: int, note: str) -> None:
        self.target = target
        self.notes.append(note)


def decide(budget: int, host: Host, guests: Sequence[Guest], params: Params = Params()) -> list[Decision]:
    """The targets to set this round, one Decision for each guest whose target changes, in the order
    of `guests`. `budget` is the lab's memory budget in bytes."""
    slots = [_slot(guest, order, params) for order, guest in enumerate(guests)]
    share = host.available + sum(guest.actual for guest in guests) - int(params.host_reserve * host.total)
    cap = min(budget, share)
    minimums = sum(slot.lo for slot in slots)
    if minimums > cap:
        why = (f"the budget {_size(budget)} is under the lab's minimums ({_size(minimums)})"
               if budget < minimums else
               f"host short: the lab's minimums ({_size(minimums)}) exceed what the host can give "
               f"({_size(max(0, share))})")
        for slot in slots:
            if slot.target != slot.lo:
                slot.move(slot.lo, f"{why}: held at its minimum {_size(slot.lo)}")
    else:
        holds = sum(slot.target for slot in slots)
        over = (f"lab over budget ({_size(holds)} of {_size(budget)})" if budget <= share else
                f"host short (the lab may hold {_size(cap)}, holds {_size(holds)})")
        _give_back(slots, params)
        _bring_under(slots, cap, over, params)
        _grow(slots, cap, params)
    return [Decision(slot.guest.name, slot.target, "; ".join(slot.notes))
            for slot in slots if slot.target != _committed(slot.guest)]


def _committed(guest: Guest) -> int:
    return guest.target if guest.target is not None else guest.actual


def _slot(guest: Guest, order: int, params: Params) -> _Slot:
    hi = _floor_mib(max(0, guest.maximum))
    # Both whole MiB in a lab (memory and balloon.min are MiB in the spec); when not, the minimum
    # rounds up, and gives way to the maximum should the two cross.
    least, what = guest.minimum, "minimum"
    if guest.floor is not None:
        # At its observed floor a guest has nothing free: it keeps the same margin over it as over
        # what it uses (see *floor*), or its next allocation OOM-kills one of its programs.
        kept = guest.floor + max(int(params.margin * guest.floor), params.margin_floor)
        if kept > least:
            least, what = kept, f"floor (it stopped giving at {_size(guest.floor)}) plus margin,"
    lo = min(_ceil_mib(max(0, least)), hi)
    committed = _committed(guest)
    slot = _Slot(guest, order, lo, hi, committed, committed)
    if committed < least or committed < lo:
        slot.move(lo, f"under its {what} {_size(lo)}: raised to it")
    elif committed > guest.maximum or committed > hi:
        slot.move(hi, f"over its maximum {_size(hi)}: lowered to it")
    slot.size = slot.target
    return slot


def _give_back(slots: list[_Slot], params: Params) -> None:
    for slot in slots:
        if slot.plenty(params):
            bound = slot.give_bound(params)
            if slot.target - bound >= params.dead_band:
                gives = slot.target - bound
                slot.move(bound, f"plenty: {_spare(slot)} (over {_percent(params.plenty)}): "
                                 f"gives {_size(gives)} back")


def _bring_under(slots: list[_Slot], cap: int, over: str, params: Params) -> None:
    excess = sum(slot.target for slot in slots) - cap
    with_stats = sorted((slot for slot in slots if slot.stats and not slot.short(params)),
                        key=lambda slot: (-slot.spare, slot.guest.name, slot.order))
    # A guest without stats may need all it has; it gives only what those with stats could not.
    without = sorted((slot for slot in slots if not slot.stats),
                     key=lambda slot: (slot.lo - slot.target, slot.guest.name, slot.order))
    for slot in [*with_stats, *without]:
        if excess <= 0:
            return
        bound = slot.give_bound(params)
        wanted = max(excess, params.dead_band)  # a step worth making, the surplus is headroom
        target = max(bound, _floor_mib(slot.target - wanted))
        if target >= slot.target:
            continue
        gives = slot.target - target
        excess -= gives
        if slot.stats:
            slot.move(target, f"{over}: {_spare(slot)}: gives {_size(gives)}")
        else:
            slot.move(target, f"no stats yet; {over}: gives {_size(gives)} toward its minimum "
                              f"{_size(slot.lo)}")


def _grow(slots: list[_Slot], cap: int, params: Params) -> None:
    headroom = cap - sum(slot.target for slot in slots)
    if headroom < 0:
        return  # still over the cap: everything that could be given went to the budget
    short = sorted((slot for slot in slots if slot.short(params)),
                   key=lambda slot: (slot.spare_fraction, slot.guest.name, slot.order))
    # Not short, so able to spare memory down to used + margin: a short guest's need comes before
    # their comfort. Guests without stats may need all they have and are not asked.
    donors = sorted((slot for slot in slots if slot.stats and not slot.short(params)),
                    key=lambda slot: (-_free(slot), slot.guest.name, slot.order))
    for slot in short:
        wanted = _growth(slot, params)
        if wanted < params.dead_band:
            continue
        gifts = _gifts(donors, wanted - headroom, params)
        grows = min(wanted, headroom + sum(donor.target - target for donor, target in gifts))
        target = _floor_mib(slot.target + grows)
        if target - slot.target < params.dead_band:
            continue
        for donor, donor_target in gifts:
            headroom += donor.target - donor_target
            donor.move(donor_target, f"{slot.guest.name} is short: {_spare(donor)}: "
                                     f"gives {_size(donor.target - donor_target)}")
        limit = (" (its maximum)" if target == slot.hi else
                 " (all the lab has left)" if grows < wanted else "")
        headroom -= target - slot.target
        slot.move(target, f"{_why_short(slot, params)}: grows by {_size(target - slot.target)}{limit}")


def _growth(slot: _Slot, params: Params) -> int:
    """How much a short guest asks for this round, as a move to a whole MiB; 0 for nothing."""
    step = int(params.grow_step * slot.guest.maximum)
    goal = _ceil_mib(int(slot.used / (1 - params.aim))) if slot.short_of_memory(params) else 0
    if slot.thrashing(params):
        # From the actual size: a step set last round that the balloon has not reached yet is not
        # asked for again.
        goal = max(goal, slot.guest.actual + step)
    if goal <= slot.target:
        return 0
    wanted = min(max(goal - slot.target, params.dead_band), step, slot.hi - slot.target)
    return max(0, _floor_mib(slot.target + wanted) - slot.target)


def _gifts(donors: list[_Slot], needed: int, params: Params) -> list[tuple[_Slot, int]]:
    """The donors' new targets that would free `needed`, the most free memory first; none moves
    by less than the dead band, so the last one may free a little more."""
    gifts = []
    for donor in donors:
        if needed <= 0:
            break
        bound = donor.give_bound(params)
        if donor.target - bound < params.dead_band:
            continue
        target = max(bound, _floor_mib(donor.target - max(needed, params.dead_band)))
        gifts.append((donor, target))
        needed -= donor.target - target
    return gifts


def _free(slot: _Slot) -> int:
    free = slot.guest.free
    return free if free is not None else slot.spare


def _why_short(slot: _Slot, params: Params) -> str:
    guest = slot.guest
    if slot.short_of_memory(params):
        return f"short: {_spare(slot)} (under {_percent(params.short)})"
    if guest.major_faults > params.fault_rate:
        return f"short: {guest.major_faults:.0f} major faults/s (over {params.fault_rate:g})"
    return f"short: swapping in {_size(int(guest.swap_in))}/s (over {params.fault_rate:g} pages/s)"


def _spare(slot: _Slot) -> str:
    return f"{_size(max(0, slot.spare))} available of {_size(slot.size)}"


def _percent(fraction: float) -> str:
    return f"{fraction * 100:g} %"


def _size(size: int) -> str:
    """To the nearest MiB, in M or G: "40M", "2G", "1536M"; a log line needs no byte."""
    mib = round(size / MIB)
    return format_size(mib * MIB) if mib else "0M"


def _floor_mib(size: int) -> int:
    return size // MIB * MIB


def _ceil_mib(size: int) -> int:
    return -(-size // MIB) * MIB
