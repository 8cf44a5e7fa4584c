"""One MoE layer forward of the megakernel under each transfer policy: the receive layout and
rounds (:mod:`sim.layer.plan`), the push / pull dispatch and combine (:mod:`sim.layer.policies`),
the layer's task graph (:mod:`sim.layer.model`; the backward's: :mod:`sim.layer.backward`), its
results (:mod:`sim.layer.results`), the sweeps, comparisons and tuner over configs
(:mod:`sim.layer.sweep`) and the DeepEP + torch-best baseline (:mod:`sim.layer.baseline`). Built
on :mod:`sim.core`; the opt-in kernel profile and the baseline's DeepEP rates take their rates
from :mod:`sim.comm`.
"""
