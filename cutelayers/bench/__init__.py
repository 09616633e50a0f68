"""Benchmarks and the autotuner: everything that times kernels.

* ``python -m cutelayers.bench FAMILY ...`` (:mod:`.__main__`): one module per family --
  :mod:`.reduce`, :mod:`.norms`, :mod:`.softmax`, :mod:`.gemm`, :mod:`.lm_head`, :mod:`.compile`;
* ``python -m cutelayers.bench.autotune ...`` (:mod:`.autotune`): sweep kernel configs, write the
  winners to the tuned-config table that :mod:`cutelayers.tuning` reads;
* :mod:`.timing`: the timing both use.
"""
