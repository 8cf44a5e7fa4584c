"""The fused layer kernel (one persistent launch) against its measurements: the fitted knobs
(:mod:`sim.fused.profile`), the GEMM tile order and its list schedule (:mod:`sim.fused.tiles`),
the layer's time (:mod:`sim.fused.model`), the fit (:mod:`sim.fused.fit`) and the tuner
(:mod:`sim.fused.tune`). Uses :mod:`sim.comm` (schedule kernel, copy-loop terms) and
:mod:`sim.layer` (the receive layout).
"""
