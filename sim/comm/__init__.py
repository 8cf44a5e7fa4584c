"""The standalone comm kernels of mok against their measurements: what each kernel moves
(:mod:`sim.comm.catalog`), how it walks its rows (:mod:`sim.comm.rows`), its comm-engine rates
(:mod:`sim.comm.rates`), the fitted knobs (:mod:`sim.comm.profile`), the kernels as task graphs
(:mod:`sim.comm.model`) and the fit (:mod:`sim.comm.fit`); DeepEP's kernels as a fitted rate
law (:mod:`sim.comm.deepep`, the baseline's communication). Built on :mod:`sim.core`.
"""
