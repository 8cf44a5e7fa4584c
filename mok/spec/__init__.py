"""The contract every part of the project shares, free of torch and CUDA.

* :mod:`mok.spec.workload`: model shapes (:data:`PRESETS`), routing skews and traces.
* :mod:`mok.spec.config`: :class:`MoKConfig`, its JSON format and the transfer modes.
* :mod:`mok.spec.limits`: what the fused layer supports, and why a case is unsupported; how
  experts split over ranks.
* :mod:`mok.spec.arch`: which of mok's paths run on which GPU (by compute capability).
* :mod:`mok.spec.rows`: the provenance columns of benchmark CSV rows (git sha, routing seed).

``reference``, ``mok`` and ``sim`` import these; nothing here imports them back.
"""
