"""One MoE layer forward of the megakernel under each transfer policy: the receive layout and
rounds (:mod:`sim.layer.plan`), the push / pull dispatch and combine (:mod:`sim.layer.policies`),
the layer's task graph (:mod:`sim.layer.model`), its results (:mod:`sim.layer.results`) and the
sweeps, comparisons and tuner over configs (:mod:`sim.layer.sweep`). Built on :mod:`sim.core`;
the opt-in kernel profile takes its rates from :mod:`sim.comm`.
"""
