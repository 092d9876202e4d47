"""Evaluation harness: speed against the verifier alone and Hugging Face, task accuracy,
divergence, and plots (``cactus-spec bench``).

Modules, one idea each: ``tasks`` (items and answer checking), ``grid`` (configurations),
``store`` (the run directory), ``peers`` (Hugging Face baselines), ``memory`` (peak memory),
``provenance`` (versions and model identities), ``runner`` (the alternating loop),
``stats`` (intervals), ``bound`` (the i.i.d. speedup bound), ``summary`` (per-configuration
figures), ``report`` (markdown), ``plots`` (PNG figures) and ``command`` (the CLI glue).
"""
