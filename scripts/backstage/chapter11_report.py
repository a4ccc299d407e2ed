"""Chapter 11's summary and verdicts: what its numbers say, computed for the page (printed by
the launching process), and the cost model's questions about ZeRO-3 past one box."""

from __future__ import annotations

MIB = 2**20
STAGE_NAMES = {"ddp": "DDP", "zero1_ours": "ZeRO-1 (ours)",
               "zero1_native": "ZeRO-1 (ZeroRedundancyOptimizer)", "zero2": "ZeRO-2 (ours)",
               "fsdp_ours": "FSDP (ours)", "fully_shard": "FSDP (fully_shard)"}
# A 7B-class transformer layer (12·h² parameters, h = 4096) in bf16, at 40% of an H100's peak.
LAYER_PARAMS, SEQUENCE = 12 * 4096**2, 4096
COST_LINKS, COST_GPUS = ("nvlink4", "ib-ndr", "eth-100g"), (8, 64, 1024)


def cost_model(costmodel) -> dict:
    """ZeRO-3's traffic against DDP's, and the tokens per rank where its gathers hide."""
    rows = []
    for link in COST_LINKS:
        for gpus in COST_GPUS:
            found = costmodel.fsdp_hiding_threshold(LAYER_PARAMS, gpus, link=link)
            rows.append({"link": link, "gpus": gpus, **found,
                         "sequences_per_rank": found["tokens_per_rank"] / SEQUENCE})
    return {"layer_params": LAYER_PARAMS, "sequence": SEQUENCE, "bytes_per_param": 2,
            "peak_tflops": 989.0, "mfu": 0.4,
            "traffic_at_8": costmodel.zero3_bytes_per_step(1.0, 8),
            "traffic_kept_at_8": costmodel.zero3_bytes_per_step(1.0, 8, False),
            "thresholds": rows}


def sent_bytes(by_op: dict[str, int], world_size: int) -> dict[str, float]:
    """Bytes one rank sends for these whole messages: by a ring algorithm (what NCCL's rings
    send) and by gloo, whose reduce-scatter all-reduces the whole message and keeps a chunk."""
    from ddplab.zero2 import ring_bytes_sent
    return {"sent": sum(ring_bytes_sent(op, b, world_size) for op, b in by_op.items()),
            "sent_gloo": sum(ring_bytes_sent(op, b, world_size, gloo=True)
                             for op, b in by_op.items())}


def times_text(ratio: float) -> str:
    return f"{ratio:.2f} times" if abs(ratio - round(ratio * 2) / 2) > 0.005 else \
        f"{round(ratio * 2) / 2:g} times"


def equal_text(value: float) -> str:
    return "bitwise equal" if value == 0 else f"apart by up to {value:.2g}"


def verdicts(r: dict, backend: str) -> dict:
    """Every comparison the page draws from this run (on ``backend``), values and the phrases
    it renders."""
    eq = r["equality"]["max_abs_diff"]
    per_rank = r["ledger"]["per_rank"]
    exact = {stage: all(rank[stage]["held"][k] == rank[stage]["predicted"][k]
                        for rank in per_rank for k in ("params", "grads", "optimizer_state",
                                                      "counters"))
             for stage in STAGE_NAMES}
    peaks = {s: max(rank[s]["profiler_peak"] for rank in per_rank) for s in STAGE_NAMES}
    comm = r["communication"]
    ratio = comm["measured"]["fully_shard"]["sent"] / comm["measured"]["ddp"]["sent"]
    ratio_gloo = (comm["measured"]["fully_shard"]["sent_gloo"]
                  / comm["measured"]["ddp"]["sent_gloo"])
    acc = r["accumulation"]
    world = r["equality"]["world_size"]
    every = sent_bytes(acc["every_micro_batch"]["bytes_per_step"], world)
    once = sent_bytes(acc["once_per_step"]["bytes_per_step"], world)
    out = {
        "equal": {k: equal_text(v) for k, v in eq.items()},
        "ledger_exact": exact,
        "ledger_exact_text": {s: "to the byte" if ok else "not to the byte"
                              for s, ok in exact.items()},
        "ledger_all_exact": all(exact.values()),
        "peak_mib": {s: v / MIB for s, v in peaks.items()},
        "fsdp_peak_over_ddp": peaks["fully_shard"] / peaks["ddp"],
        "ours_peak_over_native": peaks["fsdp_ours"] / peaks["fully_shard"],
        "fsdp_sends_over_ddp": ratio,
        "fsdp_sends_text": times_text(ratio),
        "fsdp_sends_gloo_over_ddp": ratio_gloo,
        "fsdp_sends_gloo_text": times_text(ratio_gloo),
        "sent_by_this_run": "gloo's" if backend == "gloo" else "the ring's",
        "accumulate_bytes_ratio": every["sent"] / once["sent"],
        "accumulate_bytes_gloo_ratio": every["sent_gloo"] / once["sent_gloo"],
        "accumulate_held_ratio": (acc["once_per_step"]["gradients_held"]
                                  / acc["every_micro_batch"]["gradients_held"]),
        "accumulate_modes_text": equal_text(acc["modes_differ_by"]),
        "local_norm_off_by": max(abs(n - acc["clipping"]["full_model_norm"])
                                 / acc["clipping"]["full_model_norm"]
                                 for n in acc["clipping"]["local_norm_per_rank"]),
    }
    out["fsdp_ours_params_text"] = hand_fsdp_params(per_rank)
    out.update(ledger_texts(r["ledger"], exact))
    out["accumulate_native_text"] = {mode: equal_text(acc[mode]["ours_vs_fully_shard"])
                                     for mode in ("every_micro_batch", "once_per_step")}
    out["clip_grads_text"] = clip_gap(acc["clipping"]["grads_max_abs_diff"])
    out["fsdp_ours_sends_text"] = ours_sends(comm["measured"])
    if "equality_3" in r:
        out["equal_3"] = {k: equal_text(v) for k, v in r["equality_3"]["max_abs_diff"].items()}
    timeline = comm["timeline"]
    out["timeline_comm_share"] = sum(e["end_ms"] - e["start_ms"] for e in timeline["events"]
                                     if e["kind"] != "forward") / timeline["end_ms"]
    halves = comm["ring_halves"].get("sizes")
    if halves:
        largest = halves[-1]["median_ms"]
        out["ring_rs_over_gloo_rs"] = largest["ring_reduce_scatter"] / largest[
            "gloo_reduce_scatter"]
        out["gloo_rs_over_all_reduce"] = largest["gloo_reduce_scatter"] / largest[
            "gloo_all_reduce"]
        out["ring_rs_faster"] = ("faster than" if out["ring_rs_over_gloo_rs"] < 1
                                 else "slower than")
        out["halves_equal"] = equal_text(max(max(row["reduce_scatter_max_abs_diff"],
                                                 row["all_gather_max_abs_diff"])
                                             for row in halves))
        out["halves_order_note"] = (" (at 2 ranks any order of adding gives the same sum, so "
                                    "this checks which chunk goes where, not the order)"
                                    if world == 2 else "")
        out["gloo_rs_over_all_reduce_text"] = per_size_text(
            [(row["bytes"], row["median_ms"]["gloo_reduce_scatter"]
              / row["median_ms"]["gloo_all_reduce"]) for row in halves])
    reshard = r.get("reshard", {})
    if "continued_max_abs_diff" in reshard:
        out["reshard_text"] = equal_text(reshard["continued_max_abs_diff"])
    return out


def ledger_texts(ledger: dict, exact: dict) -> dict:
    """The ledger's phrases: every stage to the byte or not, ZeRO-1's state on rank 0, ours
    against ZeroRedundancyOptimizer, and the paper's totals per stage."""
    per_rank = ledger["per_rank"]
    state = [rank["zero1_native"]["held"]["optimizer_state"] for rank in per_rank]
    alike = all(rank["zero1_ours"]["held"] == rank["zero1_native"]["held"] for rank in per_rank)
    return {
        "ledger_all_exact_text": ("every bar equals its formula to the byte"
                                  if all(exact.values()) else
                                  "not every bar equals its formula: see the ≠ marks"),
        "zero1_rank0_state_share": state[0] / sum(state),
        "zero1_alike_text": ("with `ZeroRedundancyOptimizer` and with ours alike" if alike else
                             "with `ZeroRedundancyOptimizer`; ours holds other bytes"),
        "paper_total_gb": [sum(stage[k] for k in ("params", "grads", "optimizer_state")) / 1e9
                           for stage in ledger["paper"]["mixed_adam"]],
    }


def clip_gap(grads_max_abs_diff: float) -> str:
    """Why the global norm of the shards and DDP's norm differ at all."""
    if grads_max_abs_diff == 0:
        return ("float32 rounding of two summation orders over the same, bitwise-equal, "
                "gradients")
    return (f"the gradients themselves differ by up to {grads_max_abs_diff:.2g}, and the two "
            "norms add their squares in different orders")


def ours_sends(measured: dict) -> str:
    """FullyShardedDP's calls and message bytes against fully_shard's."""
    ours, theirs = measured["fsdp_ours"], measured["fully_shard"]
    if (ours["calls"], ours["by_op"]) == (theirs["calls"], theirs["by_op"]):
        return "the same calls and message bytes"
    return (f"{ours['calls']} calls and {ours['messages']:,} message bytes against "
            f"`fully_shard`'s {theirs['calls']} and {theirs['messages']:,}")


def per_size_text(rows: list[tuple[int, float]]) -> str:
    """``1.83 times at 1 MiB, 1.12 at 4 MiB and 1.49 at 16 MiB``."""
    parts = [f"{ratio:.2f}{' times' if i == 0 else ''} at {nbytes / 2**20:.3g} MiB"
             for i, (nbytes, ratio) in enumerate(rows)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def hand_fsdp_params(per_rank: list) -> str:
    """What FullyShardedDP's parameters cost on rank 0, against its formula and DDP's."""
    held = per_rank[0]["fsdp_ours"]["held"]["params"]
    if held == per_rank[0]["fsdp_ours"]["predicted"]["params"]:
        return "its shards' bytes, as the formula says"
    if held == per_rank[0]["ddp"]["held"]["params"]:
        return ("the whole model's parameter bytes, as DDP does: each shard is a view into its "
                "full parameter (a slice of rows is contiguous, so `.contiguous()` copies "
                "nothing) and keeps that parameter's whole storage alive")
    return f"{held:,} B of parameters where the formula says " \
           f"{per_rank[0]['fsdp_ours']['predicted']['params']:,} B"


def summarize(r: dict, prov: dict) -> str:
    v, eq = r["verdicts"], r["equality"]["max_abs_diff"]
    lines = [f"Chapter 11 on {prov['world_size']} ranks ({prov['backend']}, {prov['device']}), "
             f"{r['model']['numel']:,} parameters",
             "", "Bytes held on rank 0 after a step (measured = formula?) and profiler peak:"]
    for stage, name in STAGE_NAMES.items():
        held = r["ledger"]["per_rank"][0][stage]["held"]["total"]
        lines.append(f"  {name:36s} {held:>10,} B  {v['ledger_exact_text'][stage]:17s} "
                     f"peak {v['peak_mib'][stage]:.2f} MiB")
    lines += ["", f"Largest difference after {r['equality']['steps']} steps (0 = bit for bit):"]
    lines += [f"  {k:34s} {val:g}" for k, val in eq.items()]
    if "equality_3" in r:
        lines += ["", "The same at 3 ranks:"]
        lines += [f"  {k:34s} {val:g}" for k, val in r["equality_3"]["max_abs_diff"].items()]
        first = r["equality_3"]["first_difference"]
        if first:
            lines.append(f"  first element the layouts sum differently: {first['element']}, "
                         f"offset {first['shard_major_offset']} shard-major, "
                         f"{first['parameter_major_offset']} parameter-major")
    lines += ["", f"fully_shard sends {v['fsdp_sends_over_ddp']:.2f}x DDP's bytes per step in a "
              f"ring, {v['fsdp_sends_gloo_over_ddp']:.2f}x on gloo; "
              f"reducing every micro-batch sends {v['accumulate_bytes_ratio']:.2f}x once per "
              "step"]
    if "reshard_text" in v:
        lines.append(f"DCP saved at 2 ranks, continued at 3: {v['reshard_text']}")
    return "\n".join(lines)
