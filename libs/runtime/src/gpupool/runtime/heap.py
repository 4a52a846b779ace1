"""After the rebuild: the rebuilt state out of the cyclic garbage collector's way.

A service process holds, once it has rebuilt, a projection of the whole log (or of its
node): tens of thousands of objects that live as long as the process. CPython's cyclic
collector walks every tracked object of the oldest generation on each full collection;
under a burst those came every few hundred placements and walked the whole projection
each time (docs/benchmarks.md, "The admission-queue's CPU per placement, outside the
wire"). :func:`settle_after_rebuild` collects once, then freezes what is left
(``gc.freeze``): the collector ignores those objects from then on. Reference counting
still frees them when the state lets go of them; only a reference cycle among them would
never be collected, and the state is a tree (``State`` -> nodes and pods, keyed by name
and ``PodRef``), its events frozen structs that the collector does not track at all
(``gc=False``).
"""

from __future__ import annotations

import gc


def settle_after_rebuild() -> None:
    """Collect what the rebuild left as garbage; freeze the rest out of later collections."""
    gc.collect()
    gc.freeze()
