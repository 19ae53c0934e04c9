"""Several objectives at once (sweep.metric a list, one direction each): which trials no other
trial beats (the Pareto front), how much of the objective space a front covers (its hypervolume,
the measure two fronts are compared by), and the rule a sweep's pruner applies at an evaluation
(`DominatedPruner`: stopped when k completed trials were better on every objective at that step).

Pure functions of numbers: `minimize` says, per objective, whether it is better low. A trial
dominates another when it is no worse on every objective and better on at least one; the front
is the trials no other dominates.
"""

import math
from collections.abc import Hashable, Sequence

Values = Sequence[float]


def _low(values: Values, minimize: Sequence[bool]) -> tuple[float, ...]:
    """The values turned so that lower is better on every objective."""
    return tuple(v if low else -v for v, low in zip(values, minimize))


def dominates(a: Values, b: Values, minimize: Sequence[bool]) -> bool:
    """Whether `a` is no worse than `b` on every objective and better on at least one."""
    a, b = _low(a, minimize), _low(b, minimize)
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def beats_on_every(a: Values, b: Values, minimize: Sequence[bool]) -> bool:
    """Whether `a` is better than `b` on every objective (the pruning rule's sense of beaten)."""
    return all(x < y for x, y in zip(_low(a, minimize), _low(b, minimize)))


def front(points: dict[Hashable, Values], minimize: Sequence[bool]) -> list[Hashable]:
    """The keys of the points no other point dominates (points with a nan are left out), in the
    order given."""
    usable = {k: v for k, v in points.items() if all(math.isfinite(x) for x in v)}
    return [k for k, v in usable.items() if not any(dominates(w, v, minimize) for j, w in usable.items() if j != k)]


def hypervolume(points: Sequence[Values], minimize: Sequence[bool], reference: Values) -> float:
    """The volume of the objective space that the points dominate, bounded by `reference` (a
    point worse than every point on every objective): the larger, the better the front. Exact, by
    slicing along the last objective (fine for the tens of points a sweep's front has)."""
    ref = _low(reference, minimize)
    inside = [p for p in (_low(v, minimize) for v in points) if all(x < r for x, r in zip(p, ref))]
    return _sliced(inside, ref)


def _sliced(points: list[tuple[float, ...]], ref: tuple[float, ...]) -> float:
    if not points:
        return 0.0
    if len(ref) == 1:
        return ref[0] - min(p[0] for p in points)
    ordered = sorted(points, key=lambda p: p[-1])
    volume = 0.0
    for i, p in enumerate(ordered):
        upper = ordered[i + 1][-1] if i + 1 < len(ordered) else ref[-1]
        if upper > p[-1]:  # the slab up to the next point is dominated by the points below it
            volume += (upper - p[-1]) * _sliced([q[:-1] for q in ordered[: i + 1]], ref[:-1])
    return volume


def beaten_by(values: Values, others: Sequence[Values], minimize: Sequence[bool]) -> int:
    """How many of `others` are better than `values` on every objective."""
    return sum(beats_on_every(o, values, minimize) for o in others)
