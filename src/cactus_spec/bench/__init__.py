"""Evaluation harness: speed against the verifier alone and the peers, task accuracy,
divergence, and plots (``cactus-spec bench``).

Modules, one idea each: ``tasks`` (items), ``grading`` (scores per task), ``humaneval``
(completion extraction), ``execution`` and ``sandbox`` (tests run in an isolated
interpreter), ``grid`` (configurations), ``store`` (the run directory), ``peers`` (Hugging
Face baselines), ``llamacpp`` (llama.cpp baselines), ``memory`` (peak memory),
``provenance`` (versions and model identities), ``runner`` (the alternating loop),
``rescore`` (grade recorded texts again), ``stats`` (intervals), ``bound`` (the i.i.d.
speedup bound), ``summary`` (per-configuration figures), ``report`` (markdown), ``plots``
(PNG figures), ``command`` (the command line's glue) and ``demo`` (``cactus-spec demo``:
AR, SpS and Cactus side by side). Finished runs read back: ``finished`` (a run folder's
records and summary), ``diff`` (runs of one grid compared), ``quality`` (the quality tables
of scored runs) and ``post`` (``cactus-spec bench ratio``, ``diff``, ``quality-table``).
"""
