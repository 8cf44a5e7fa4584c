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
# # Scaling expert parallelism: 2 GPUs -> one HGX -> one NVL72 rack -> several racks
#
# The same MoE layer with a fixed number of tokens per rank (weak scaling) on:
#
# * `h200x2` EP2: our two-GPU measurement box (NV18);
# * `hgx-h200` EP8: one HGX board behind NVSwitch;
# * `gb300-nvl72`: one rack, at the largest EP that fits 72 GPUs and divides the expert count;
# * `gb300-nvl72x2` / `x4`: two / four racks; traffic between racks leaves through each GPU's
#   scale-out NIC, an order of magnitude slower than NVLink.
#
# For each step: the layer time and its critical-path breakdown, the share of it that is
# exposed communication, and how the payload splits between NVLink and the NIC. The H200 and
# GB300 steps use different GPUs, so the GEMM part changes along with the fabric.

# %%
# %matplotlib inline
from IPython.display import display

from mok.spec.workload import get_shape
from sim.app.plots import scaling_summary
from sim.config import SimConfig, Workload
from sim.core.topology import get_topology
from sim.layer.sweep import compare

# %% tags=["parameters"]
# deepseek-v3 (256 experts) divides EP 2/8/64/128/256; kimi-k2 (384 experts) gives 64/128/192
# on the racks below.
SHAPE = "deepseek-v3"
# 512 tokens/rank keeps the notebook fast (EP256 is the slowest step); 4096-8192 is a realistic
# training micro-batch and takes minutes at EP256.
TOKENS_PER_RANK = 512
# (topology, EP); "max": the largest EP that fits the topology and divides the expert count
STEPS = [
    ("h200x2", 2),
    ("hgx-h200", 8),
    ("gb300-nvl72", "max"),
    ("gb300-nvl72x2", "max"),
    ("gb300-nvl72x4", "max"),
]
SKEW = "uniform"
POLICIES = (("pull", "push"), ("dedup_pull", "push"))  # (dispatch, combine) pairs
NUM_COMM_SMS = 24
MINIBATCH_SIZE = 2048
RING_SLOTS = 4
SEED = 0

# %% [markdown]
# ## Pick the EP of each step and simulate

# %%
num_experts = get_shape(SHAPE).num_experts


def resolve_ep(topology: str, ep: int | str) -> int:
    """``ep`` itself, or for "max" the largest EP <= the topology's GPUs dividing the experts."""
    if ep != "max":
        return int(ep)
    gpus = get_topology(topology).num_gpus
    return max(e for e in range(1, gpus + 1) if num_experts % e == 0)


base = SimConfig(
    num_comm_sms=NUM_COMM_SMS,
    minibatch_size=MINIBATCH_SIZE,
    macrobatch_size=RING_SLOTS * MINIBATCH_SIZE,
)
steps = []
for topology, ep in STEPS:
    ep = resolve_ep(topology, ep)
    if num_experts % ep:
        print(f"skip {topology} EP{ep}: {SHAPE} has {num_experts} experts")
        continue
    steps.append((topology, ep))
rows = []
for topology, ep in steps:
    wl = Workload(SHAPE, TOKENS_PER_RANK, ep, topology, SKEW, seed=SEED)
    rows += [r.summary() for r in compare(wl, base, POLICIES)]
print(f"{SHAPE}: steps " + ", ".join(f"{t} EP{ep}" for t, ep in steps))

# %% [markdown]
# ## Table
#
# `rows/expert` is the mean number of (token, k) rows each local expert receives,
# `tokens_per_rank * num_topk * EP / num_experts`; each expert region is padded to the GEMM row
# tile, so below one tile the GEMMs mostly multiply padding.


# %%
def rows_per_expert(r: dict) -> float:
    return r["tokens_per_rank"] * get_shape(r["shape"]).num_topk * r["ep"] / num_experts


head = (
    f"{'topology':<15}{'EP':>4} {'policy':<16}{'layer us':>9}{'gemm':>8}{'exp.comm':>9}"
    f"{'exp.%':>7}{'idle%':>7}{'NVL MB/rk':>10}{'NIC MB/rk':>10}{'rows/expert':>12}"
)
print(head)
print("-" * len(head))
for r in rows:
    print(
        f"{r['topology']:<15}{r['ep']:>4} {r['dispatch_mode'] + '/' + r['combine_mode']:<16}"
        f"{r['layer_us']:>9.1f}{r['gemm_us']:>8.1f}{r['exposed_comm_us']:>9.1f}"
        f"{100 * r['exposed_comm_us'] / r['layer_us']:>6.1f}%"
        f"{100 * r['compute_idle_frac']:>6.1f}%"
        f"{r['nvlink_payload_mb'] / r['ep']:>10.1f}{r['nic_payload_mb'] / r['ep']:>10.1f}"
        f"{rows_per_expert(r):>12.0f}"
    )

# %% [markdown]
# ## Figures: breakdown, exposed communication share, NVLink vs NIC payload per rank

# %%
for dispatch, combine in POLICIES:
    display(scaling_summary(rows, {"dispatch_mode": dispatch, "combine_mode": combine}))

# %% [markdown]
# ## Findings (computed from the rows above)

# %%
d0, c0 = POLICIES[0]
main = [r for r in rows if (r["dispatch_mode"], r["combine_mode"]) == (d0, c0)]
one_domain = [r for r in main if r["ep"] <= get_topology(r["topology"]).gpus_per_domain]
multi = [r for r in main if r not in one_domain]


def share(r: dict) -> float:
    return r["exposed_comm_us"] / r["layer_us"]


def nic_frac(r: dict) -> float:
    total = r["nvlink_payload_mb"] + r["nic_payload_mb"]
    return r["nic_payload_mb"] / total if total else 0.0


print(
    f"{d0}/{c0} layer time at {TOKENS_PER_RANK} tokens/rank: "
    + " -> ".join(f"{r['layer_us']:.0f} us ({r['topology']} EP{r['ep']})" for r in main)
    + "."
)
small = main[0]
print(
    f"At {small['topology']} EP{small['ep']} a local expert gets {rows_per_expert(small):.0f} "
    f"rows on average against a {small['row_tile']}-row tile, at {main[-1]['topology']} "
    f"EP{main[-1]['ep']} {rows_per_expert(main[-1]):.0f}: growing EP at fixed tokens per rank "
    "fills the GEMM tiles."
)
if one_domain:
    print(
        f"Inside one NVLink domain exposed communication is at most "
        f"{max(map(share, one_domain)):.1%} of the layer (NIC payload "
        f"{sum(r['nic_payload_mb'] for r in one_domain):.0f} MB)."
    )
if multi:
    print(
        "Across racks it is "
        + ", ".join(f"{share(r):.1%} at EP{r['ep']}" for r in multi)
        + ", with "
        + ", ".join(f"{nic_frac(r):.0%}" for r in multi)
        + " of the payload on the NIC and the compute SMs idle "
        + ", ".join(f"{r['compute_idle_frac']:.0%}" for r in multi)
        + " of the layer."
    )
if len(POLICIES) > 1:
    d1, c1 = POLICIES[1]
    alt = {
        (r["topology"], r["ep"]): r
        for r in rows
        if (r["dispatch_mode"], r["combine_mode"]) == (d1, c1)
    }
    print(
        f"{d1}/{c1} vs {d0}/{c0} NVLink payload: "
        + ", ".join(
            f"{alt[(r['topology'], r['ep'])]['nvlink_payload_mb'] / r['nvlink_payload_mb']:.2f}x "
            f"at EP{r['ep']}"
            for r in main
        )
        + "; layer time "
        + ", ".join(
            f"{alt[(r['topology'], r['ep'])]['layer_us'] / r['layer_us']:.3f}x" for r in main
        )
        + "."
    )
