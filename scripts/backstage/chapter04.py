"""What a bucket-size sweep shows against its own noise.

The model has two ends: many small buckets pay a collective's fixed cost many times; one bucket
waits for the last gradient.  Caps that make the same number of buckets give a measure of the
sweep's noise (the three smallest caps of chapter 04 make the very same buckets); an end counts
as slower or faster only where it is apart from the other points by more than that.
"""

from __future__ import annotations


def caps_text(caps: list[float]) -> str:
    caps = sorted(caps)
    return f"cap {caps[0]:g} MiB" if len(caps) == 1 else f"caps {caps[0]:g} to {caps[-1]:g} MiB"


def compare(inside: list[float], others: list[float], noise: float, whom: str) -> str:
    """How a group of step times stands against ``whom`` (the ``others``), given the noise."""
    if min(inside) - max(others) > noise:
        return (f"slower than every {whom}, by at least {min(inside) - max(others):.1f} ms, "
                f"more than that noise")
    if min(others) - max(inside) > noise:
        return (f"faster than every {whom}, by at least {min(others) - max(inside):.1f} ms, "
                f"more than that noise")
    return f"not apart from every {whom} by more than that noise"


def sweep_verdict(points: list[dict], kind: str) -> dict:
    """The noise (largest spread among caps with the same number of buckets) and how each end
    of the curve stands against it: the most buckets against every other cap, one bucket (the
    fewest) against the caps in between."""
    groups: dict[int, list[dict]] = {}
    for p in points:
        groups.setdefault(p["buckets"][kind], []).append(p)
    ms = {count: [p["step_time_ms"][kind] for p in group] for count, group in groups.items()}
    repeated = [times for times in ms.values() if len(times) > 1]
    if not repeated:
        return {"noise_ms": None,
                "text": "no two caps made the same number of buckets, so the sweep has no "
                        "measure of its own noise and this run does not read its curve"}
    noise = max(max(times) - min(times) for times in repeated)
    most, fewest = max(ms), min(ms)
    text = (f"caps that make the same number of buckets spread by up to {noise:.1f} ms, the "
            f"sweep's own noise")
    if most == fewest:
        return {"noise_ms": noise, "text": text + "; every cap made the same buckets",
                "plain": "every cap made the same buckets"}

    def end(count: int, against: list[int], words: str, whom: str) -> str:
        caps = caps_text([p["bucket_cap_mb"] for p in groups[count]])
        others = [t for c in against for t in ms[c]]
        return f"{words} ({count}, {caps}) were {compare(ms[count], others, noise, whom)}"

    text += "; against it, " + end(most, [c for c in ms if c != most],
                                   "the steps with the most buckets", "other cap")
    middle = [c for c in ms if c not in (most, fewest)]
    if middle:
        text += ", and " + end(fewest, middle, "those with the fewest",
                               "cap in between")
    return {"noise_ms": noise, "most_buckets": most, "fewest_buckets": fewest, "text": text,
            "plain": plain_reading(ms, most, fewest, noise)}


def buckets_text(count: int) -> str:
    return f"{count} bucket{'s' if count != 1 else ''}"


def plain_reading(ms: dict[int, list[float]], most: int, fewest: int, noise: float) -> str:
    """The sweep in one plain clause, "{noise}" left for the caller to fill in: no cap faster
    than another, or which end of the curve (the smallest caps, the largest) stood out."""
    every = [t for times in ms.values() for t in times]
    if max(every) - min(every) <= noise:
        return (f"no bucket cap was measurably faster than another: the spread between caps, "
                f"{max(every) - min(every):.1f} ms, was within the sweep's own noise ({{noise}})")
    ends = [("the smallest caps", most, [c for c in ms if c != most], "other caps"),
            ("the largest caps", fewest, [c for c in ms if c not in (most, fewest)],
             "caps in between")]
    apart = []
    for name, count, against, whom in ends:
        others = [t for c in against for t in ms[c]]
        if not others:
            continue
        if min(ms[count]) - max(others) > noise:
            apart.append(f"{name} ({buckets_text(count)}) were slower than the {whom}")
        elif min(others) - max(ms[count]) > noise:
            apart.append(f"{name} ({buckets_text(count)}) were faster than the {whom}")
    if not apart:
        return (f"neither the smallest caps ({buckets_text(most)}) nor the largest "
                f"({buckets_text(fewest)}) were measurably slower or faster than the other caps: "
                f"the differences stayed within the sweep's own noise ({{noise}})")
    return " and ".join(apart) + " by more than the sweep's own noise ({noise})"


NAMES = {"bucketed": "BucketedDDP", "native": "native DDP"}


def sweep_reading(verdict: dict[str, dict]) -> str:
    """Both DDPs' plain clauses as one sentence, "For both DDPs, …" when they read the same."""
    def noise(kind: str) -> str:
        ms = verdict[kind]["noise_ms"]
        return "none measured" if ms is None else f"{ms:.1f} ms"

    def plain(kind: str) -> str:
        return verdict[kind].get("plain", verdict[kind]["text"])

    if len({plain(kind) for kind in verdict}) == 1:
        noises = ", ".join(f"{noise(kind)} for {NAMES[kind]}" for kind in verdict)
        return "For both DDPs, " + plain(next(iter(verdict))).format(noise=noises)
    apart = "; ".join(f"for {NAMES[kind]}, {plain(kind).format(noise=noise(kind))}"
                      for kind in verdict)
    return apart[0].upper() + apart[1:]
