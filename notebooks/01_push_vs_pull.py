# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Push vs pull vs dedup-pull across topologies, EP sizes and routing skew
#
# Each (token, k) row of an MoE layer has to reach the rank that owns its expert and come back.
# The simulator (`sim`) models four ways of doing that inside the megakernel:
#
# * `push/push`: the source stores rows into the expert owner, the owner stores results back
#   (DeepEP-style); every round needs a fence and a remote flag per peer;
# * `pull/push`: MoK's default, the expert owner loads its rows, then pushes the results back;
# * `pull/pull`: both directions are loads issued by the receiver;
# * `dedup_pull/push`: one NVLink row per (token, destination rank) instead of per (token, k),
#   fanned out locally; the combine sends one pre-reduced partial per (token, rank).
#
# Dedup saves bytes when a token sends several of its k rows to the same rank, which is likely
# when there are few ranks (EP2..8) and rare when there are many (EP64+). This notebook measures
# how much NVLink traffic that saves and whether it changes the layer time.

# %%
# %matplotlib inline
from IPython.display import display

from sim.app.plots import policy_comparison
from sim.config import SimConfig, Workload
from sim.layer.sweep import COMPARE_POLICIES, compare

# %% tags=["parameters"]
# model preset (mok.spec.workload.PRESETS); its experts must divide every EP below
SHAPE = "deepseek-v3"
# Tokens per rank: 512 keeps the notebook under ~20 s on a laptop; 4096-8192 is a realistic
# training micro-batch (and minutes of simulation at EP128).
TOKENS_PER_RANK = 512
# (topology, EP): two H200 on NV18, an HGX box, one GB300 NVL72 rack, two racks over the NIC.
CASES = [
    ("h200x2", 2),
    ("hgx-h200", 4),
    ("hgx-h200", 8),
    ("gb300-nvl72", 8),
    ("gb300-nvl72", 64),
    ("gb300-nvl72x2", 128),
]
SKEWS = ["uniform", "zipf:1.2", "hot:0.3"]  # mok.spec.workload.Skew.parse syntax
NUM_COMM_SMS = 24
MINIBATCH_SIZE = 2048  # received rows per rank per round
RING_SLOTS = 4  # macrobatch_size = RING_SLOTS * MINIBATCH_SIZE
SEED = 0

# %% [markdown]
# ## Simulate every case under the four policies
#
# The same seeded routing trace is used for all policies of one (topology, EP, skew) case.

# %%
base = SimConfig(
    num_comm_sms=NUM_COMM_SMS,
    minibatch_size=MINIBATCH_SIZE,
    macrobatch_size=RING_SLOTS * MINIBATCH_SIZE,
)
rows = []
for topology, ep in CASES:
    for skew in SKEWS:
        wl = Workload(SHAPE, TOKENS_PER_RANK, ep, topology, skew, seed=SEED)
        rows += [r.summary() for r in compare(wl, base, COMPARE_POLICIES)]
print(f"simulated {len(rows)} layers")

# %% [markdown]
# ## Table: layer time per policy and NVLink payload per rank (pull vs dedup-pull)


# %%
def pick(topology: str, ep: int, skew: str, dispatch: str, combine: str = "push") -> dict:
    return next(
        r
        for r in rows
        if (r["topology"], r["ep"], r["skew"], r["dispatch_mode"], r["combine_mode"])
        == (topology, ep, skew, dispatch, combine)
    )


policies = [f"{d}/{c}" for d, c in COMPARE_POLICIES]
head = f"{'topology':<15}{'EP':>4} {'skew':<9}" + "".join(f"{p:>16}" for p in policies)
head += f"{'NVL MB pull':>13}{'NVL MB dedup':>14}{'ratio':>7}"
print("layer time (us) per policy; NVLink payload MB per rank")
print(head)
print("-" * len(head))
for topology, ep in CASES:
    for skew in SKEWS:
        times = [pick(topology, ep, skew, d, c)["layer_us"] for d, c in COMPARE_POLICIES]
        mb_pull = pick(topology, ep, skew, "pull")["nvlink_payload_mb"] / ep
        mb_dedup = pick(topology, ep, skew, "dedup_pull")["nvlink_payload_mb"] / ep
        print(
            f"{topology:<15}{ep:>4} {skew:<9}"
            + "".join(f"{t:>16.1f}" for t in times)
            + f"{mb_pull:>13.1f}{mb_dedup:>14.1f}{mb_pull / mb_dedup:>6.2f}x"
        )

# %% [markdown]
# ## Figure: layer time (log scale) and NVLink MB per rank

# %%
display(policy_comparison(rows))

# %% [markdown]
# ## Findings (computed from the rows above)

# %%
by_ep: dict[int, list[float]] = {}
for topology, ep in CASES:
    for skew in SKEWS:
        pull = pick(topology, ep, skew, "pull")["nvlink_payload_mb"]
        dedup = pick(topology, ep, skew, "dedup_pull")["nvlink_payload_mb"]
        by_ep.setdefault(ep, []).append(pull / dedup)
saving = {ep: sum(v) / len(v) for ep, v in sorted(by_ep.items())}
small = [ep for ep in saving if ep <= 8]
large = [ep for ep in saving if ep > 8]
# how much of the layer is exposed communication where dedup saves the most bytes
exposed_small = max(
    (r["exposed_comm_us"] / r["layer_us"] for r in rows if r["ep"] in small), default=0.0
)

gains = []  # (best non-dedup time / dedup time, case)
for topology, ep in CASES:
    for skew in SKEWS:
        others = min(
            pick(topology, ep, skew, d, c)["layer_us"]
            for d, c in COMPARE_POLICIES
            if d != "dedup_pull"
        )
        gains.append(
            (others / pick(topology, ep, skew, "dedup_pull")["layer_us"], topology, ep, skew)
        )
best_gain, worst_gain = max(gains), min(gains)
push_gap = max(
    (
        pick(t, ep, s, "push", "push")["layer_us"] / pick(t, ep, s, "pull", "push")["layer_us"],
        t,
        ep,
        s,
    )
    for t, ep in CASES
    for s in SKEWS
)

print(
    "Dedup-pull cuts NVLink payload per rank by "
    + ", ".join(f"{saving[ep]:.2f}x at EP{ep}" for ep in small)
    + "; at larger EP only by "
    + ", ".join(f"{saving[ep]:.2f}x at EP{ep}" for ep in large)
    + " (with many ranks a token's k experts rarely share a rank)."
)
print(
    f"Layer time: dedup-pull's speedup over the best other policy ranges from "
    f"{worst_gain[0]:.3f}x ({worst_gain[1]} EP{worst_gain[2]} {worst_gain[3]}) to "
    f"{best_gain[0]:.3f}x ({best_gain[1]} EP{best_gain[2]} {best_gain[3]}); at EP<=8 and "
    f"{TOKENS_PER_RANK} tokens/rank exposed communication is at most {exposed_small:.1%} of "
    "the layer, which bounds what the saved bytes can buy there."
)
gap_push = pick(*push_gap[1:], "push", "push")
gap_pull = pick(*push_gap[1:], "pull", "push")
print(
    f"Push vs pull dispatch (both with push combine): push/push takes up to {push_gap[0]:.2f}x "
    f"the layer time of pull/push ({push_gap[1]} EP{push_gap[2]} {push_gap[3]}: "
    f"{gap_push['exposed_comm_us']:.0f} vs {gap_pull['exposed_comm_us']:.0f} us of exposed "
    f"communication, {gap_push['nic_payload_mb'] / push_gap[2]:.0f} MB/rank over the NIC)."
)
