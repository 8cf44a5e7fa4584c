"""The simulation machinery every model shares: GPU profiles (:mod:`sim.core.hardware`),
topologies and their flow-network resources (:mod:`sim.core.topology`), max-min fair bandwidth
sharing (:mod:`sim.core.flows`), the task graph and its event loop (:mod:`sim.core.engine`, with
:mod:`sim.core.simpy_engine` as a cross-check), grouped-GEMM tile rates (:mod:`sim.core.gemm`)
and transfers as flows (:mod:`sim.core.transfer`). Imports no other part of ``sim``.
"""
