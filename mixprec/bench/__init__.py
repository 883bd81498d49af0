"""The benchmark harness behind ``mixprec bench`` and ``benchmarks/*.py``.

* :mod:`~mixprec.bench.models` -- the reference models (the Keras guide's MLP, a small GPT);
* :mod:`~mixprec.bench.corpus` and :mod:`~mixprec.bench.workloads` -- data and workloads;
* :mod:`~mixprec.bench.runner` -- every mode trained round-robin in one process;
* :mod:`~mixprec.bench.steps` -- step-time and memory ratios, interleaved;
* :mod:`~mixprec.bench.report` -- tables, JSON and plots that name their machine.
"""
