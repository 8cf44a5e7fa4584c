"""What people run: the ``mok-sim`` command line (:mod:`sim.app.cli`, its argument and path
checks :mod:`sim.app.cli_args`, its first-run compile notice :mod:`sim.app.jit_cache`), the
scoring of predictions against measurements (:mod:`sim.app.validate`; a train run's backward
kernels beside the model's pieces: :mod:`sim.app.bwd_pieces`), the GPU-profile fit from
a probe (:mod:`sim.app.calibrate`), the ``mok-config/1`` writer (:mod:`sim.app.emit`), figures
(:mod:`sim.app.plots`, those of measured runs :mod:`sim.app.measured_plots`, the
push-signalling sensitivity ones :mod:`sim.app.sensitivity`, their shared names, units and
colours :mod:`sim.app.labels`), Chrome traces (:mod:`sim.app.trace`) and
the simulator's speed benchmark (:mod:`sim.app.bench`).
"""
