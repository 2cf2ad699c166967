"""The persistent Gluon kernels' work order (``@gluon.jit`` helpers, inlined), over a device-built
work list (``schedule.build_work_list``) of items times heads: static, program ``p`` of ``G``
taking ``w = p, p + G, ...`` (:func:`item_and_head` maps ``w`` to an item and a head), or dynamic:
each program's producer draws ``w`` from a global ticket (:func:`fetch_add`) and hands it to its
consumers through a shared slot (:func:`publish_item` / :func:`take_item`); the last program to
finish zeroes the ticket for the next launch (:func:`retire_program`).
"""

from __future__ import annotations

from thd.ops.attention.gluon.compat import cta_barrier, gl, gluon, mbarrier

__all__ = ["fetch_add", "item_and_head", "publish_item", "retire_program", "take_item"]


@gluon.jit
def item_and_head(w, total, num_heads, head_section, serpentine):
    """List item ``item`` (a query tile in the forward, a key tile in the persistent backward) and
    ``head`` of this program's work item ``w`` of ``total = tiles * num_heads``. Program ``p`` of
    ``G`` takes ``p, p + G, ...``; with ``serpentine`` every other full round of ``G`` is taken in
    reverse (program ``p`` gets ``G - 1 - p`` of it), so the program with a round's longest item
    gets the next round's shortest. The list: the heads in sections of ``head_section`` (a divisor
    of ``num_heads``), one section after another, each section's tiles longest first with its heads
    innermost. Fewer heads at a time means more programs on one head's data at once, so it stays in
    L2; ``head_section == num_heads`` is one section."""
    if serpentine:
        programs = gl.num_programs(0)
        lap = w // programs
        if ((lap & 1) == 1) & ((lap + 1) * programs <= total):
            w = (2 * lap + 1) * programs - 1 - w
    row = w // head_section  # section * tiles + item
    tiles = total // num_heads
    section = row // tiles
    return row - section * tiles, section * head_section + w - row * head_section


@gluon.jit
def fetch_add(ptr, SEM: gl.constexpr):
    """``ptr[0] += 1`` by the partition's first thread; every thread gets the old value (a scalar
    atomic would be every thread's, and ptxas merges a warp's into one add of 32)."""
    W: gl.constexpr = gl.num_warps()
    threads: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    offs = gl.arange(0, 32 * W, layout=threads)
    first = offs == 0
    old = gl.atomic_add(ptr + offs * 0, gl.full([32 * W], 1, gl.int32, threads), mask=first, sem=SEM)
    return gl.max(gl.where(first, old, -1), axis=0)


@gluon.jit
def publish_item(items, item_bars, slot, w):
    """The producer (one warp) hands work item ``w`` to the consumers through ``slot`` (item
    parity): every lane's store, then the slot's barrier."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(slot).store(gl.full([1], w, gl.int32, layout=one))
    cta_barrier()
    mbarrier.arrive(item_bars.index(slot))


@gluon.jit
def take_item(items, item_bars, t):
    """A consumer's ``t``-th work item, from the slot the producer published it in."""
    W: gl.constexpr = gl.num_warps()
    one: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    slot = t & 1
    mbarrier.wait(item_bars.index(slot), (t >> 1) & 1)
    return gl.sum(items.index(slot).load(one), axis=0)


@gluon.jit
def retire_program(ticket_ptr):
    """Once a program's producer has drawn its last ticket (``ticket_ptr[0]``): count the program
    done (``ticket_ptr[1]``); the last one counted zeroes both for the next launch (every ticket is
    drawn by then)."""
    if fetch_add(ticket_ptr + 1, "acq_rel") == gl.num_programs(0) - 1:
        gl.store(ticket_ptr, 0)
        gl.store(ticket_ptr + 1, 0)
